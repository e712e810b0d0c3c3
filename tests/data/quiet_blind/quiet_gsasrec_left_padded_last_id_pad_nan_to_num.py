"""gSASRec (asash/gSASRec-pytorch) next-item recommender, shrunk.

Ported from asash/gSASRec-pytorch @027f3f1302e02acff801a409dd38d7ade81bc4a0:
  gsasrec.py            GSASRec.forward / get_predictions
  transformer_decoder.py MultiHeadAttention.forward / TransformerBlock.forward
  dataset_utils.py      SequenceDataset.__getitem__ (left padding, pad id = num_items + 1)
  train_gsasrec.py      training step (labels shifted by one, loss masked where label == pad)
  gbce.py               gBCE

Masking as in the project:
  * histories are LEFT-padded with the id num_items + 1 (the last embedding row, not 0);
  * embeddings are multiplied by (input != pad) so pad slots are exact zero vectors, and
    every block ends with `x *= mask`;
  * inside attention the key mask is sign(sum(|keys|)) on the raw (un-normed) block input,
    the causal mask is a tril, both filled with -inf; rows with no allowed key (pad
    queries before the first item) are NaN after softmax and are zeroed on purpose by
    nan_to_num; the query mask sign(sum(|queries|)) then multiplies the weights;
  * heads are split by chunking the feature dim and concatenating along the batch dim.
The next-item score is read at the last position (always a real item with left padding).

The check: every user's real positions, the top-k recommendations and the masked
training loss are compared with an independent per-user, per-position loop that only
ever looks at that user's real items (with the same absolute position ids).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


# ---------------------------------------------------------------- project code (ported)
class MultiHeadAttention(nn.Module):
    def __init__(self, dim, num_heads, dropout_rate=0.5):
        super().__init__()
        self.num_heads = num_heads
        self.query_proj = nn.Linear(dim, dim)
        self.key_proj = nn.Linear(dim, dim)
        self.val_proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, queries, keys, causality=False):
        Q = self.query_proj(queries)
        K = self.key_proj(keys)
        V = self.val_proj(keys)

        Q_ = torch.cat(Q.chunk(self.num_heads, dim=2), dim=0)
        K_ = torch.cat(K.chunk(self.num_heads, dim=2), dim=0)
        V_ = torch.cat(V.chunk(self.num_heads, dim=2), dim=0)

        outputs = torch.matmul(Q_, K_.transpose(1, 2))
        outputs = outputs / (K_.size(-1) ** 0.5)

        # Key Masking
        key_masks = torch.sign(torch.sum(torch.abs(keys), dim=-1))
        key_masks = key_masks.repeat(self.num_heads, 1)
        key_masks = key_masks.unsqueeze(1).repeat(1, queries.size(1), 1)
        outputs = outputs.masked_fill(key_masks == 0, float('-inf'))

        # Causality
        if causality:
            diag_vals = torch.ones_like(outputs[0])
            tril = torch.tril(diag_vals)
            masks = tril[None, :, :].repeat(outputs.size(0), 1, 1)
            outputs = outputs.masked_fill(masks == 0, float('-inf'))

        outputs = F.softmax(outputs, dim=-1)
        outputs = torch.nan_to_num(outputs, nan=0.0, posinf=0.0, neginf=0.0)

        # Query Masking
        query_masks = torch.sign(torch.sum(torch.abs(queries), dim=-1))
        query_masks = query_masks.repeat(self.num_heads, 1)
        query_masks = query_masks.unsqueeze(-1).repeat(1, 1, keys.size(1))
        outputs *= query_masks

        attention_weights = outputs
        outputs = self.dropout(outputs)
        outputs = torch.matmul(outputs, V_)
        outputs = torch.cat(outputs.chunk(self.num_heads, dim=0), dim=2)
        return outputs, attention_weights


class TransformerBlock(nn.Module):
    def __init__(self, dim, num_heads, hidden_dim, dropout_rate=0.5, causality=True):
        super().__init__()
        self.first_norm = nn.LayerNorm(dim)
        self.second_norm = nn.LayerNorm(dim)
        self.multihead_attention = MultiHeadAttention(dim, num_heads, dropout_rate)
        self.dense1 = nn.Linear(dim, hidden_dim)
        self.dense2 = nn.Linear(hidden_dim, dim)
        self.dropout = nn.Dropout(dropout_rate)
        self.causality = causality

    def forward(self, seq, mask=None):
        x = self.first_norm(seq)
        queries = x
        keys = seq
        x, attentions = self.multihead_attention(queries, keys, self.causality)
        x = x + queries
        x = self.second_norm(x)
        residual = x
        x = self.dense1(x)
        x = self.dropout(x)
        x = self.dense2(x)
        x = self.dropout(x)
        x = x + residual
        if mask is not None:
            x *= mask
        return x, attentions


class GSASRec(nn.Module):
    def __init__(self, num_items, sequence_length=200, embedding_dim=256, num_heads=4, num_blocks=3,
                 dropout_rate=0.5):
        super().__init__()
        self.num_items = num_items
        self.sequence_length = sequence_length
        self.embedding_dim = embedding_dim
        self.embeddings_dropout = nn.Dropout(dropout_rate)
        self.num_heads = num_heads
        self.item_embedding = nn.Embedding(self.num_items + 2, self.embedding_dim)
        self.position_embedding = nn.Embedding(self.sequence_length, self.embedding_dim)
        self.transformer_blocks = nn.ModuleList([
            TransformerBlock(self.embedding_dim, self.num_heads, self.embedding_dim, dropout_rate)
            for _ in range(num_blocks)
        ])
        self.seq_norm = nn.LayerNorm(self.embedding_dim)

    def forward(self, input):
        seq = self.item_embedding(input)
        mask = (input != self.num_items + 1).float().unsqueeze(-1)
        bs = seq.size(0)
        positions = torch.arange(seq.shape[1]).unsqueeze(0).repeat(bs, 1).to(input.device)
        pos_embeddings = self.position_embedding(positions)[:input.size(0)]
        seq = seq + pos_embeddings
        seq = self.embeddings_dropout(seq)
        seq *= mask
        attentions = []
        for block in self.transformer_blocks:
            seq, attention = block(seq, mask)
            attentions.append(attention)
        seq_emb = self.seq_norm(seq)
        return seq_emb, attentions

    def get_predictions(self, input, limit, rated=None):
        with torch.no_grad():
            model_out, _ = self.forward(input)
            seq_emb = model_out[:, -1, :]
            preds = torch.matmul(seq_emb, self.item_embedding.weight[:-1].transpose(0, 1))
            if rated is not None:
                for i in range(len(input)):
                    for j in rated[i]:
                        preds[i, j] = float("-inf")
            preds[:, 0] = float("-inf")
            result = torch.topk(preds, limit, dim=1)
            return result.indices, result.values


class gBCE(nn.Module):
    def __init__(self, pool_size, negatives, t):
        super().__init__()
        self.alpha = negatives / (pool_size - 1)
        self.beta = self.alpha * (t * (1 - 1 / self.alpha) + 1 / self.alpha)

    def forward(self, logits, targets):
        pos = targets * F.softplus(-logits)
        neg = (1.0 - targets) * F.softplus(logits)
        return self.beta * pos + neg


def pad_history(inp, padding_value, max_length):
    """SequenceDataset.__getitem__: keep the last max_length items, pad on the left."""
    if len(inp) > max_length:
        inp = inp[-max_length:]
    elif len(inp) < max_length:
        inp = [padding_value] * (max_length - len(inp)) + inp
    return torch.tensor(inp, dtype=torch.long)


# ---------------------------------------------------------------- independent reference
def ref_user_states(model, items, seq_len):
    """Hidden state after seq_norm for each real item of one user, computed with explicit
    loops over positions, only over that user's real items. Item t of n sits at absolute
    position seq_len - n + t (left padding). Also returns the empty-history state."""
    n = len(items)
    H = model.num_heads
    D = model.embedding_dim
    dh = D // H
    emb = model.item_embedding.weight
    pos = model.position_embedding.weight
    xs = [emb[it] + pos[seq_len - n + t] for t, it in enumerate(items)]
    for blk in model.transformer_blocks:
        att = blk.multihead_attention
        new = []
        for t in range(n):
            q_in = blk.first_norm(xs[t])
            q = att.query_proj(q_in)
            outs = []
            for h in range(H):
                sl = slice(h * dh, (h + 1) * dh)
                scores = torch.stack([(q[sl] * att.key_proj(xs[s])[sl]).sum() / dh ** 0.5 for s in range(t + 1)])
                w = torch.softmax(scores, dim=0)
                outs.append(sum(w[s] * att.val_proj(xs[s])[sl] for s in range(t + 1)))
            y = torch.cat(outs) + q_in
            y = blk.second_norm(y)
            y = blk.dense2(blk.dense1(y)) + y
            new.append(y)
        xs = new
    states = [model.seq_norm(x) for x in xs]
    # empty history (a pad input slot whose label is the user's first item): the block
    # output is multiplied by a zero mask, so the state is seq_norm of a zero vector.
    empty = model.seq_norm(torch.zeros(D))
    return states, empty


def main():
    num_items, L, D, H, blocks = 20, 8, 16, 2, 2
    pad = num_items + 1
    model = GSASRec(num_items, sequence_length=L, embedding_dim=D, num_heads=H, num_blocks=blocks,
                    dropout_rate=0.5)
    # "trained" layer norms: non-zero biases, so pad queries are non-zero vectors and the
    # fully masked pad rows really go through the nan_to_num path.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.3)
    model.eval()

    histories = [
        [3, 7, 1, 9, 12, 4, 18, 2, 6, 11],   # longer than L: truncated to its last L items
        [5, 14, 8, 20, 13],
        [17, 2, 9],
        [10],
    ]
    ok = True

    # ---- evaluation: hidden states and top-k with rated items filtered
    batch = torch.stack([pad_history(h, pad, L) for h in histories])
    with torch.no_grad():
        out, attn = model(batch)
        idx, vals = model.get_predictions(batch, limit=5, rated=[set(h) for h in histories])
        # NaN must not have survived anywhere
        ok &= bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(a).all()) for a in attn)
        for b, h in enumerate(histories):
            items = h[-L:]
            n = len(items)
            states, _ = ref_user_states(model, items, L)
            ref = torch.stack(states)
            got = out[b, L - n:]
            ok &= torch.allclose(got, ref, atol=1e-5)
            preds = ref[-1] @ model.item_embedding.weight[:-1].T
            for j in set(h):
                preds[j] = float("-inf")
            preds[0] = float("-inf")
            rv, ri = torch.topk(preds, 5)
            ok &= torch.equal(ri, idx[b]) and torch.allclose(rv, vals[b], atol=1e-5)
            # attention weights of pad queries are exactly zero, of real queries sum to one
            for a in attn:
                wa = a.view(H, len(histories), L, L)[:, b]
                ok &= bool((wa[:, :L - n] == 0).all())
                ok &= torch.allclose(wa[:, L - n:].sum(-1), torch.ones(H, n), atol=1e-5)

    # ---- training step loss (train_gsasrec.py), input padded to L + 1 then shifted
    negs = 3
    loss_fct = gBCE(pool_size=num_items - 1, negatives=negs, t=0.75)
    positives = torch.stack([pad_history(h, pad, L + 1) for h in histories])
    g = torch.Generator().manual_seed(1)
    negatives = torch.randint(low=1, high=pad, size=(positives.size(0), positives.size(1), negs), generator=g)
    with torch.no_grad():
        model_input = positives[:, :-1]
        last_hidden_state, _ = model(model_input)
        labels = positives[:, 1:]
        neg = negatives[:, 1:, :]
        pos_neg_concat = torch.cat([labels.unsqueeze(-1), neg], dim=-1)
        pos_neg_embeddings = model.item_embedding(pos_neg_concat)
        mask = (labels != num_items + 1).float().unsqueeze(-1).repeat(1, 1, 1, negs + 1)
        scores = torch.einsum('bld,blnd->bln', last_hidden_state, pos_neg_embeddings)
        gt = torch.zeros_like(scores)
        gt[:, :, 0] = 1
        loss = loss_fct(scores, gt) * mask
        mean_loss = loss.sum() / mask.sum()

        # reference: for each user, targets are items[1:] predicted from prefixes, plus the
        # first item predicted from the empty history when it fits in the window.
        tot, cnt = 0.0, 0
        for b, h in enumerate(histories):
            window = h[-(L + 1):]
            inp, tgt = window[:-1], window[1:]
            states, empty = ref_user_states(model, inp, L)
            rows = []  # (state, label position in the padded labels tensor)
            n_lab = len(window) - 1
            if len(window) < L + 1:
                rows.append((empty, L - len(window)))   # label = first item, input = pad
            for t in range(len(inp)):
                rows.append((states[t], L - n_lab + t))
            for st, p in rows:
                cand = model.item_embedding(pos_neg_concat[b, p])
                s = cand @ st
                tot += (loss_fct.beta * F.softplus(-s[0]) + F.softplus(s[1:]).sum()).item()
                cnt += negs + 1
        ref_loss = tot / cnt
        ok &= abs(mean_loss.item() - ref_loss) < 1e-5

    print("gSASRec left-padded batch matches per-user reference:", bool(ok))
    assert ok


if __name__ == "__main__":
    main()
