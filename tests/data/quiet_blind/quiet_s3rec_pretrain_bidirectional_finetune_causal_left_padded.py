"""S3Rec (aHuiWang/CIKM2020-S3Rec) self-supervised sequential recommender, shrunk.

Ported from aHuiWang/CIKM2020-S3Rec:
  models.py   @e6c774da92dba847b00ac89e8bfc5c55cc44d378  S3RecModel.pretrain / finetune / add_position_embedding
  modules.py  @e6c774da92dba847b00ac89e8bfc5c55cc44d378  SelfAttention, Intermediate, Layer, Encoder, LayerNorm
  datasets.py @622fc7cbc44eff2ea208aa1a8aa645c317ff516c  PretrainDataset.__getitem__, SASRecDataset.__getitem__
  trainers.py @622fc7cbc44eff2ea208aa1a8aa645c317ff516c  Trainer.cross_entropy, predict_full ([:, -1, :])

The same encoder is run with two different masks:
  * pretraining (AAP / MIP / MAP / SP losses) is BIDIRECTIONAL: a key padding bias
    `(ids == 0) * -1e8` of shape (B, 1, 1, L); [mask] tokens (mask_id) are real keys;
  * fine-tuning is SASRec-like: `(input_ids > 0)` times a tril (triu(diagonal=1) == 0),
    turned into an additive `(1 - m) * -10000` bias of shape (B, 1, L, L).
All sequences are LEFT-padded with item 0 and position ids are arange over the padded
length, so the last slot is always a real item; the segment-prediction context and the
next-item prediction read [:, -1, :]. Pad query rows in fine-tuning see no allowed key and
get a finite uniform row (finite fill); their outputs are dropped by `istarget`.

The check: encoder outputs at real positions, the four pretraining losses, the fine-tune
loss and the full-sort scores all match an independent per-sequence loop over positions
that only sees that sequence's real items (same absolute position ids, no mask tensor).
"""
import copy
import math
import random
from types import SimpleNamespace

import torch
import torch.nn as nn

torch.manual_seed(0)
random.seed(0)


# ---------------------------------------------------------------- modules.py (ported)
def gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-12):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class SelfAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.num_attention_heads = args.num_attention_heads
        self.attention_head_size = int(args.hidden_size / args.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(args.hidden_size, self.all_head_size)
        self.key = nn.Linear(args.hidden_size, self.all_head_size)
        self.value = nn.Linear(args.hidden_size, self.all_head_size)
        self.attn_dropout = nn.Dropout(args.attention_probs_dropout_prob)
        self.dense = nn.Linear(args.hidden_size, args.hidden_size)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=1e-12)
        self.out_dropout = nn.Dropout(args.hidden_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, input_tensor, attention_mask):
        query_layer = self.transpose_for_scores(self.query(input_tensor))
        key_layer = self.transpose_for_scores(self.key(input_tensor))
        value_layer = self.transpose_for_scores(self.value(input_tensor))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.attn_dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(*new_context_layer_shape)
        hidden_states = self.dense(context_layer)
        hidden_states = self.out_dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class Intermediate(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.dense_1 = nn.Linear(args.hidden_size, args.hidden_size * 4)
        self.intermediate_act_fn = gelu
        self.dense_2 = nn.Linear(args.hidden_size * 4, args.hidden_size)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(args.hidden_dropout_prob)

    def forward(self, input_tensor):
        hidden_states = self.dense_1(input_tensor)
        hidden_states = self.intermediate_act_fn(hidden_states)
        hidden_states = self.dense_2(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class Layer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = SelfAttention(args)
        self.intermediate = Intermediate(args)

    def forward(self, hidden_states, attention_mask):
        return self.intermediate(self.attention(hidden_states, attention_mask))


class Encoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        layer = Layer(args)
        self.layer = nn.ModuleList([copy.deepcopy(layer) for _ in range(args.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask, output_all_encoded_layers=True):
        all_encoder_layers = []
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
            if output_all_encoded_layers:
                all_encoder_layers.append(hidden_states)
        if not output_all_encoded_layers:
            all_encoder_layers.append(hidden_states)
        return all_encoder_layers


# ---------------------------------------------------------------- models.py (ported)
class S3RecModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.item_embeddings = nn.Embedding(args.item_size, args.hidden_size, padding_idx=0)
        self.attribute_embeddings = nn.Embedding(args.attribute_size, args.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(args.max_seq_length, args.hidden_size)
        self.item_encoder = Encoder(args)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(args.hidden_dropout_prob)
        self.args = args
        self.aap_norm = nn.Linear(args.hidden_size, args.hidden_size)
        self.mip_norm = nn.Linear(args.hidden_size, args.hidden_size)
        self.map_norm = nn.Linear(args.hidden_size, args.hidden_size)
        self.sp_norm = nn.Linear(args.hidden_size, args.hidden_size)
        self.criterion = nn.BCELoss(reduction='none')
        self.apply(self.init_weights)

    def associated_attribute_prediction(self, sequence_output, attribute_embedding):
        sequence_output = self.aap_norm(sequence_output)
        sequence_output = sequence_output.view([-1, self.args.hidden_size, 1])
        score = torch.matmul(attribute_embedding, sequence_output)
        return torch.sigmoid(score.squeeze(-1))

    def masked_item_prediction(self, sequence_output, target_item):
        sequence_output = self.mip_norm(sequence_output.view([-1, self.args.hidden_size]))
        target_item = target_item.view([-1, self.args.hidden_size])
        score = torch.mul(sequence_output, target_item)
        return torch.sigmoid(torch.sum(score, -1))

    def masked_attribute_prediction(self, sequence_output, attribute_embedding):
        sequence_output = self.map_norm(sequence_output)
        sequence_output = sequence_output.view([-1, self.args.hidden_size, 1])
        score = torch.matmul(attribute_embedding, sequence_output)
        return torch.sigmoid(score.squeeze(-1))

    def segment_prediction(self, context, segment):
        context = self.sp_norm(context)
        score = torch.mul(context, segment)
        return torch.sigmoid(torch.sum(score, dim=-1))

    def add_position_embedding(self, sequence):
        seq_length = sequence.size(1)
        position_ids = torch.arange(seq_length, dtype=torch.long, device=sequence.device)
        position_ids = position_ids.unsqueeze(0).expand_as(sequence)
        item_embeddings = self.item_embeddings(sequence)
        position_embeddings = self.position_embeddings(position_ids)
        sequence_emb = item_embeddings + position_embeddings
        sequence_emb = self.LayerNorm(sequence_emb)
        sequence_emb = self.dropout(sequence_emb)
        return sequence_emb

    def pretrain(self, attributes, masked_item_sequence, pos_items, neg_items,
                 masked_segment_sequence, pos_segment, neg_segment):
        sequence_emb = self.add_position_embedding(masked_item_sequence)
        sequence_mask = (masked_item_sequence == 0).float() * -1e8
        sequence_mask = torch.unsqueeze(torch.unsqueeze(sequence_mask, 1), 1)
        encoded_layers = self.item_encoder(sequence_emb, sequence_mask, output_all_encoded_layers=True)
        sequence_output = encoded_layers[-1]

        attribute_embeddings = self.attribute_embeddings.weight
        # AAP
        aap_score = self.associated_attribute_prediction(sequence_output, attribute_embeddings)
        aap_loss = self.criterion(aap_score, attributes.view(-1, self.args.attribute_size).float())
        aap_mask = (masked_item_sequence != self.args.mask_id).float() * (masked_item_sequence != 0).float()
        aap_loss = torch.sum(aap_loss * aap_mask.flatten().unsqueeze(-1))
        # MIP
        pos_item_embs = self.item_embeddings(pos_items)
        neg_item_embs = self.item_embeddings(neg_items)
        pos_score = self.masked_item_prediction(sequence_output, pos_item_embs)
        neg_score = self.masked_item_prediction(sequence_output, neg_item_embs)
        mip_distance = torch.sigmoid(pos_score - neg_score)
        mip_loss = self.criterion(mip_distance, torch.ones_like(mip_distance, dtype=torch.float32))
        mip_mask = (masked_item_sequence == self.args.mask_id).float()
        mip_loss = torch.sum(mip_loss * mip_mask.flatten())
        # MAP
        map_score = self.masked_attribute_prediction(sequence_output, attribute_embeddings)
        map_loss = self.criterion(map_score, attributes.view(-1, self.args.attribute_size).float())
        map_mask = (masked_item_sequence == self.args.mask_id).float()
        map_loss = torch.sum(map_loss * map_mask.flatten().unsqueeze(-1))
        # SP
        segment_context = self.add_position_embedding(masked_segment_sequence)
        segment_mask = (masked_segment_sequence == 0).float() * -1e8
        segment_mask = torch.unsqueeze(torch.unsqueeze(segment_mask, 1), 1)
        segment_encoded_layers = self.item_encoder(segment_context, segment_mask, output_all_encoded_layers=True)
        segment_context = segment_encoded_layers[-1][:, -1, :]

        pos_segment_emb = self.add_position_embedding(pos_segment)
        pos_segment_mask = (pos_segment == 0).float() * -1e8
        pos_segment_mask = torch.unsqueeze(torch.unsqueeze(pos_segment_mask, 1), 1)
        pos_segment_encoded_layers = self.item_encoder(pos_segment_emb, pos_segment_mask, output_all_encoded_layers=True)
        pos_segment_emb = pos_segment_encoded_layers[-1][:, -1, :]

        neg_segment_emb = self.add_position_embedding(neg_segment)
        neg_segment_mask = (neg_segment == 0).float() * -1e8
        neg_segment_mask = torch.unsqueeze(torch.unsqueeze(neg_segment_mask, 1), 1)
        neg_segment_encoded_layers = self.item_encoder(neg_segment_emb, neg_segment_mask, output_all_encoded_layers=True)
        neg_segment_emb = neg_segment_encoded_layers[-1][:, -1, :]

        pos_segment_score = self.segment_prediction(segment_context, pos_segment_emb)
        neg_segment_score = self.segment_prediction(segment_context, neg_segment_emb)
        sp_distance = torch.sigmoid(pos_segment_score - neg_segment_score)
        sp_loss = torch.sum(self.criterion(sp_distance, torch.ones_like(sp_distance, dtype=torch.float32)))
        return aap_loss, mip_loss, map_loss, sp_loss

    def finetune(self, input_ids):
        attention_mask = (input_ids > 0).long()
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        max_len = attention_mask.size(-1)
        attn_shape = (1, max_len, max_len)
        subsequent_mask = torch.triu(torch.ones(attn_shape), diagonal=1)
        subsequent_mask = (subsequent_mask == 0).unsqueeze(1)
        subsequent_mask = subsequent_mask.long()
        extended_attention_mask = extended_attention_mask * subsequent_mask
        extended_attention_mask = extended_attention_mask.to(dtype=next(self.parameters()).dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        sequence_emb = self.add_position_embedding(input_ids)
        item_encoded_layers = self.item_encoder(sequence_emb, extended_attention_mask, output_all_encoded_layers=True)
        return item_encoded_layers[-1]

    def init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.args.initializer_range)
        elif isinstance(module, LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()


# ---------------------------------------------------------------- datasets.py (ported)
def neg_sample(item_set, item_size):
    item = random.randint(1, item_size - 1)
    while item in item_set:
        item = random.randint(1, item_size - 1)
    return item


def pretrain_example(args, sequence, long_sequence, item2attribute):
    masked_item_sequence, neg_items = [], []
    item_set = set(sequence)
    for item in sequence[:-1]:
        if random.random() < args.mask_p:
            masked_item_sequence.append(args.mask_id)
            neg_items.append(neg_sample(item_set, args.item_size))
        else:
            masked_item_sequence.append(item)
            neg_items.append(item)
    masked_item_sequence.append(args.mask_id)
    neg_items.append(neg_sample(item_set, args.item_size))

    if len(sequence) < 2:
        masked_segment_sequence = sequence
        pos_segment = sequence
        neg_segment = sequence
    else:
        sample_length = random.randint(1, len(sequence) // 2)
        start_id = random.randint(0, len(sequence) - sample_length)
        neg_start_id = random.randint(0, len(long_sequence) - sample_length)
        pos_segment = sequence[start_id: start_id + sample_length]
        neg_segment = long_sequence[neg_start_id:neg_start_id + sample_length]
        masked_segment_sequence = sequence[:start_id] + [args.mask_id] * sample_length + \
            sequence[start_id + sample_length:]
        pos_segment = [args.mask_id] * start_id + pos_segment + \
            [args.mask_id] * (len(sequence) - (start_id + sample_length))
        neg_segment = [args.mask_id] * start_id + neg_segment + \
            [args.mask_id] * (len(sequence) - (start_id + sample_length))

    raw = dict(masked=masked_item_sequence, pos=list(sequence), neg=neg_items,
               mseg=masked_segment_sequence, pseg=pos_segment, nseg=neg_segment)
    pad_len = args.max_seq_length - len(sequence)
    padded = {k: ([0] * pad_len + v)[-args.max_seq_length:] for k, v in raw.items()}
    attributes = []
    for item in padded['pos']:
        attribute = [0] * args.attribute_size
        for a in item2attribute.get(str(item), []):
            attribute[a] = 1
        attributes.append(attribute)
    tensors = (torch.tensor(attributes), torch.tensor(padded['masked']), torch.tensor(padded['pos']),
               torch.tensor(padded['neg']), torch.tensor(padded['mseg']), torch.tensor(padded['pseg']),
               torch.tensor(padded['nseg']))
    return tensors, raw


def finetune_example(args, items):
    """SASRecDataset, data_type='test'."""
    input_ids = items[:-1]
    target_pos = items[1:]
    target_neg = [neg_sample(set(items), args.item_size) for _ in input_ids]
    pad_len = args.max_seq_length - len(input_ids)
    input_ids = ([0] * pad_len + input_ids)[-args.max_seq_length:]
    target_pos = ([0] * pad_len + target_pos)[-args.max_seq_length:]
    target_neg = ([0] * pad_len + target_neg)[-args.max_seq_length:]
    return torch.tensor(input_ids), torch.tensor(target_pos), torch.tensor(target_neg)


def cross_entropy(model, seq_out, pos_ids, neg_ids):
    """trainers.Trainer.cross_entropy"""
    pos_emb = model.item_embeddings(pos_ids)
    neg_emb = model.item_embeddings(neg_ids)
    pos = pos_emb.view(-1, pos_emb.size(2))
    neg = neg_emb.view(-1, neg_emb.size(2))
    seq_emb = seq_out.view(-1, model.args.hidden_size)
    pos_logits = torch.sum(pos * seq_emb, -1)
    neg_logits = torch.sum(neg * seq_emb, -1)
    istarget = (pos_ids > 0).view(pos_ids.size(0) * model.args.max_seq_length).float()
    loss = torch.sum(
        - torch.log(torch.sigmoid(pos_logits) + 1e-24) * istarget -
        torch.log(1 - torch.sigmoid(neg_logits) + 1e-24) * istarget
    ) / torch.sum(istarget)
    return loss


# ---------------------------------------------------------------- independent reference
def ref_encode(model, ids, offset, causal):
    """Encode ONE unpadded sequence `ids` whose first item sits at absolute position
    `offset`, by explicit loops: query i sees keys j in its own sequence (j <= i if causal)."""
    a = model.args
    n = len(ids)
    H, dh = a.num_attention_heads, a.hidden_size // a.num_attention_heads
    xs = [model.LayerNorm(model.item_embeddings.weight[t] + model.position_embeddings.weight[offset + i])
          for i, t in enumerate(ids)]
    for layer in model.item_encoder.layer:
        sa = layer.attention
        qs = [sa.query(x) for x in xs]
        ks = [sa.key(x) for x in xs]
        vs = [sa.value(x) for x in xs]
        new = []
        for i in range(n):
            allowed = range(i + 1) if causal else range(n)
            ctx = []
            for h in range(H):
                sl = slice(h * dh, (h + 1) * dh)
                sc = torch.stack([(qs[i][sl] * ks[j][sl]).sum() / math.sqrt(dh) for j in allowed])
                w = torch.softmax(sc, 0)
                ctx.append(sum(w[k] * vs[j][sl] for k, j in enumerate(allowed)))
            y = sa.LayerNorm(sa.dense(torch.cat(ctx)) + xs[i])
            it = layer.intermediate
            y = it.LayerNorm(it.dense_2(gelu(it.dense_1(y))) + y)
            new.append(y)
        xs = new
    return torch.stack(xs)


def bce(p, t):
    return -(t * torch.clamp(torch.log(p), min=-100) + (1 - t) * torch.clamp(torch.log(1 - p), min=-100))


def main():
    max_item, n_attr = 30, 6
    args = SimpleNamespace(item_size=max_item + 2, mask_id=max_item + 1, attribute_size=n_attr + 1,
                           hidden_size=16, num_attention_heads=2, num_hidden_layers=2, max_seq_length=8,
                           hidden_act="gelu", hidden_dropout_prob=0.5, attention_probs_dropout_prob=0.5,
                           initializer_range=0.3, mask_p=0.3)
    model = S3RecModel(args)
    model.eval()  # dropout off so the batch and the reference are comparable
    L = args.max_seq_length
    item2attribute = {str(i): [1 + (i * 7 + k) % n_attr for k in range(1 + i % 2)] for i in range(1, max_item + 1)}
    users = [
        [4, 9, 1, 22, 13, 7, 30, 2, 16, 11, 5],
        [3, 18, 25, 6, 12],
        [8, 27, 14],
        [19, 10],
    ]
    long_sequence = [it for u in users for it in u]
    ok = True

    # ---------------- pretraining: bidirectional with key padding bias -1e8
    # PretrainDataset.split_sequence: prefixes of seq[-(max_len+2):-2]
    parts = []
    for u in users:
        ids = u[-(L + 2):-2]
        parts += [ids[:i + 1] for i in range(len(ids))]
    parts = parts[::3] + parts[-1:]  # a handful of prefixes of different lengths
    exs = [pretrain_example(args, p, long_sequence, item2attribute) for p in parts]
    batch = [torch.stack([e[0][k] for e in exs]) for k in range(7)]
    with torch.no_grad():
        aap, mip, mapl, sp = model.pretrain(*batch)
        attr_emb = model.attribute_embeddings.weight
        # the encoder output of the whole masked-item batch, with the same mask pretrain() builds
        seq_mask = ((batch[1] == 0).float() * -1e8)[:, None, None, :]
        enc_batch = model.item_encoder(model.add_position_embedding(batch[1]), seq_mask)[-1]
        r_aap = r_mip = r_map = r_sp = 0.0
        for b, (_, raw) in enumerate(exs):
            n = min(len(raw['pos']), L)
            off = L - n
            masked = raw['masked'][-L:]
            out = ref_encode(model, masked, off, causal=False)
            # batched encoder outputs at real positions
            got = enc_batch[b, off:]
            ok &= torch.allclose(got, out, atol=1e-4)
            pos_items, neg_items = raw['pos'][-L:], raw['neg'][-L:]
            for i in range(n):
                tgt = torch.tensor([1.0 if a in item2attribute.get(str(pos_items[i]), []) else 0.0
                                    for a in range(args.attribute_size)])
                if masked[i] == args.mask_id:
                    ps = torch.sigmoid((model.mip_norm(out[i]) * model.item_embeddings.weight[pos_items[i]]).sum())
                    ns = torch.sigmoid((model.mip_norm(out[i]) * model.item_embeddings.weight[neg_items[i]]).sum())
                    r_mip += bce(torch.sigmoid(ps - ns), torch.tensor(1.0)).item()
                    r_map += bce(torch.sigmoid(attr_emb @ model.map_norm(out[i])), tgt).sum().item()
                else:
                    r_aap += bce(torch.sigmoid(attr_emb @ model.aap_norm(out[i])), tgt).sum().item()
            ctx = ref_encode(model, raw['mseg'][-L:], off, causal=False)[-1]
            pse = ref_encode(model, raw['pseg'][-L:], off, causal=False)[-1]
            nse = ref_encode(model, raw['nseg'][-L:], off, causal=False)[-1]
            pss = torch.sigmoid((model.sp_norm(ctx) * pse).sum())
            nss = torch.sigmoid((model.sp_norm(ctx) * nse).sum())
            r_sp += bce(torch.sigmoid(pss - nss), torch.tensor(1.0)).item()
        for got_l, ref_l in ((aap, r_aap), (mip, r_mip), (mapl, r_map), (sp, r_sp)):
            ok &= abs(got_l.item() - ref_l) < 1e-3 * max(1.0, abs(ref_l))

    # ---------------- fine-tuning: causal + padding, additive -10000
    ft = [finetune_example(args, u) for u in users]
    input_ids = torch.stack([f[0] for f in ft])
    target_pos = torch.stack([f[1] for f in ft])
    target_neg = torch.stack([f[2] for f in ft])
    with torch.no_grad():
        seq_out = model.finetune(input_ids)
        loss = cross_entropy(model, seq_out, target_pos, target_neg)
        rating_pred = seq_out[:, -1, :] @ model.item_embeddings.weight.T   # predict_full
        tot, cnt = 0.0, 0
        for b, u in enumerate(users):
            inp = u[:-1][-L:]
            n = len(inp)
            off = L - n
            out = ref_encode(model, inp, off, causal=True)
            ok &= torch.allclose(seq_out[b, off:], out, atol=1e-4)
            ok &= torch.allclose(rating_pred[b], model.item_embeddings.weight @ out[-1], atol=1e-4)
            for i in range(n):
                p = (model.item_embeddings.weight[target_pos[b, off + i]] * out[i]).sum()
                q = (model.item_embeddings.weight[target_neg[b, off + i]] * out[i]).sum()
                tot += (-torch.log(torch.sigmoid(p) + 1e-24) - torch.log(1 - torch.sigmoid(q) + 1e-24)).item()
                cnt += 1
        ok &= abs(loss.item() - tot / cnt) < 1e-4
        ok &= bool(torch.isfinite(seq_out).all())

    print("S3Rec pretrain (bidirectional) and finetune (causal) match per-sequence reference:", bool(ok))
    assert ok


if __name__ == "__main__":
    main()
