# Correct program (quiet batch quiet-r102b).
# Ported from yehjin-shin/BSARec @34036fdc8df8bdbccb896ec7f68d3ded016c328d (get_attention_mask as in
# @704a0d1d7cebf7ce7c8d7cbf01b9b6bd01797180): src/model/_abstract_model.py (SequentialRecModel.add_position_embedding,
# get_attention_mask), src/model/_modules.py (MultiHeadAttention, FrequencyLayer, BSARecLayer, BSARecBlock,
# FeedForward), src/model/bsarec.py (BSARecEncoder, BSARecModel.forward / calculate_loss), src/dataset.py
# (RecDataset.__getitem__: histories LEFT-padded with item 0 to max_seq_length), src/trainers.py (full-sort
# evaluation reads recommend_output[:, -1, :] and scores it against every item embedding).
# BSARec mixes a Fourier low/high-pass filter of the whole (padded) sequence with causal self-attention whose
# extended mask is (1 - pad_keep * causal_keep) * -10000. Only the last position (always a real item under left
# padding) is read, for the training loss and for evaluation.
# The check: every layer's attention equals a double loop over the keys each query may see (real keys at or before
# it; a pad query, with none, sees the plain softmax over all keys, as a constant -10000 shift leaves it), and the
# last-position scores and loss equal a model run whose attention is that double loop.
import copy
import math
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-12):
        super(LayerNorm, self).__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class FeedForward(nn.Module):
    def __init__(self, args):
        super(FeedForward, self).__init__()
        hidden_size = args.hidden_size
        inner_size = 4 * args.hidden_size
        self.dense_1 = nn.Linear(hidden_size, inner_size)
        self.intermediate_act_fn = self.gelu
        self.dense_2 = nn.Linear(inner_size, hidden_size)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(args.hidden_dropout_prob)

    def gelu(self, x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))

    def forward(self, input_tensor):
        hidden_states = self.dense_1(input_tensor)
        hidden_states = self.intermediate_act_fn(hidden_states)
        hidden_states = self.dense_2(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class MultiHeadAttention(nn.Module):
    def __init__(self, args):
        super(MultiHeadAttention, self).__init__()
        self.args = args
        self.num_attention_heads = args.num_attention_heads
        self.attention_head_size = int(args.hidden_size / args.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.sqrt_attention_head_size = math.sqrt(self.attention_head_size)

        self.query = nn.Linear(args.hidden_size, self.all_head_size)
        self.key = nn.Linear(args.hidden_size, self.all_head_size)
        self.value = nn.Linear(args.hidden_size, self.all_head_size)

        self.softmax = nn.Softmax(dim=-1)
        self.attn_dropout = nn.Dropout(args.attention_probs_dropout_prob)

        self.dense = nn.Linear(args.hidden_size, args.hidden_size)
        self.LayerNorm = nn.LayerNorm(args.hidden_size, eps=1e-12)
        self.out_dropout = nn.Dropout(args.hidden_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(*new_x_shape)
        return x

    def forward(self, input_tensor, attention_mask):
        mixed_query_layer = self.query(input_tensor)
        mixed_key_layer = self.key(input_tensor)
        mixed_value_layer = self.value(input_tensor)

        query_layer = self.transpose_for_scores(mixed_query_layer).permute(0, 2, 1, 3)
        key_layer = self.transpose_for_scores(mixed_key_layer).permute(0, 2, 3, 1)
        value_layer = self.transpose_for_scores(mixed_value_layer).permute(0, 2, 1, 3)

        attention_scores = torch.matmul(query_layer, key_layer)
        attention_scores = attention_scores / self.sqrt_attention_head_size
        # [batch_size heads seq_len seq_len] scores + [batch_size 1 seq_len seq_len] mask
        attention_scores = attention_scores + attention_mask

        attention_probs = self.softmax(attention_scores)
        attention_probs = self.attn_dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(*new_context_layer_shape)
        hidden_states = self.dense(context_layer)
        hidden_states = self.out_dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class FrequencyLayer(nn.Module):
    def __init__(self, args):
        super(FrequencyLayer, self).__init__()
        self.out_dropout = nn.Dropout(args.hidden_dropout_prob)
        self.LayerNorm = LayerNorm(args.hidden_size, eps=1e-12)
        self.c = args.c // 2 + 1
        self.sqrt_beta = nn.Parameter(torch.randn(1, 1, args.hidden_size))

    def forward(self, input_tensor):
        batch, seq_len, hidden = input_tensor.shape
        x = torch.fft.rfft(input_tensor, dim=1, norm='ortho')
        low_pass = x[:]
        low_pass[:, self.c:, :] = 0
        low_pass = torch.fft.irfft(low_pass, n=seq_len, dim=1, norm='ortho')
        high_pass = input_tensor - low_pass
        sequence_emb_fft = low_pass + (self.sqrt_beta ** 2) * high_pass
        hidden_states = self.out_dropout(sequence_emb_fft)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class BSARecLayer(nn.Module):
    def __init__(self, args):
        super(BSARecLayer, self).__init__()
        self.args = args
        self.filter_layer = FrequencyLayer(args)
        self.attention_layer = MultiHeadAttention(args)
        self.alpha = args.alpha

    def forward(self, input_tensor, attention_mask):
        dsp = self.filter_layer(input_tensor)
        gsp = self.attention_layer(input_tensor, attention_mask)
        hidden_states = self.alpha * dsp + (1 - self.alpha) * gsp
        return hidden_states


class BSARecBlock(nn.Module):
    def __init__(self, args):
        super(BSARecBlock, self).__init__()
        self.layer = BSARecLayer(args)
        self.feed_forward = FeedForward(args)

    def forward(self, hidden_states, attention_mask):
        layer_output = self.layer(hidden_states, attention_mask)
        feedforward_output = self.feed_forward(layer_output)
        return feedforward_output


class BSARecEncoder(nn.Module):
    def __init__(self, args):
        super(BSARecEncoder, self).__init__()
        self.args = args
        block = BSARecBlock(args)
        self.blocks = nn.ModuleList([copy.deepcopy(block) for _ in range(args.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask, output_all_encoded_layers=False):
        all_encoder_layers = [hidden_states]
        for layer_module in self.blocks:
            hidden_states = layer_module(hidden_states, attention_mask)
            if output_all_encoded_layers:
                all_encoder_layers.append(hidden_states)
        if not output_all_encoded_layers:
            all_encoder_layers.append(hidden_states)
        return all_encoder_layers


class SequentialRecModel(nn.Module):
    def __init__(self, args):
        super(SequentialRecModel, self).__init__()
        self.args = args
        self.item_embeddings = nn.Embedding(args.item_size, args.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(args.max_seq_length, args.hidden_size)
        self.batch_size = args.batch_size

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

    def init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.args.initializer_range)
        elif isinstance(module, LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()

    def get_attention_mask(self, item_seq):
        """Generate left-to-right uni-directional attention mask for multi-head attention."""
        attention_mask = (item_seq > 0).long()
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)  # torch.int64

        max_len = attention_mask.size(-1)
        attn_shape = (1, max_len, max_len)
        subsequent_mask = torch.triu(torch.ones(attn_shape), diagonal=1)  # torch.uint8
        subsequent_mask = (subsequent_mask == 0).unsqueeze(1)
        subsequent_mask = subsequent_mask.long().to(item_seq.device)

        extended_attention_mask = extended_attention_mask * subsequent_mask
        extended_attention_mask = extended_attention_mask.to(dtype=next(self.parameters()).dtype)  # fp16 compatibility
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        return extended_attention_mask

    def predict(self, input_ids, user_ids, all_sequence_output=False):
        return self.forward(input_ids, user_ids, all_sequence_output)


class BSARecModel(SequentialRecModel):
    def __init__(self, args):
        super(BSARecModel, self).__init__(args)
        self.args = args
        self.LayerNorm = LayerNorm(args.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(args.hidden_dropout_prob)
        self.item_encoder = BSARecEncoder(args)
        self.apply(self.init_weights)

    def forward(self, input_ids, user_ids=None, all_sequence_output=False):
        extended_attention_mask = self.get_attention_mask(input_ids)
        sequence_emb = self.add_position_embedding(input_ids)
        item_encoded_layers = self.item_encoder(sequence_emb, extended_attention_mask,
                                                output_all_encoded_layers=True)
        if all_sequence_output:
            sequence_output = item_encoded_layers
        else:
            sequence_output = item_encoded_layers[-1]
        return sequence_output

    def calculate_loss(self, input_ids, answers, neg_answers, same_target, user_ids):
        seq_output = self.forward(input_ids)
        seq_output = seq_output[:, -1, :]
        item_emb = self.item_embeddings.weight
        logits = torch.matmul(seq_output, item_emb.transpose(0, 1))
        loss = nn.CrossEntropyLoss()(logits, answers)
        return loss


def rec_dataset_getitem(items, max_len):
    # src/dataset.py RecDataset.__getitem__
    input_ids = items[:-1]
    answer = items[-1]
    pad_len = max_len - len(input_ids)
    input_ids = [0] * pad_len + input_ids
    input_ids = input_ids[-max_len:]
    assert len(input_ids) == max_len
    return torch.tensor(input_ids, dtype=torch.long), torch.tensor(answer, dtype=torch.long)


def predict_full(model, seq_out):
    # src/trainers.py Trainer.predict_full
    test_item_emb = model.item_embeddings.weight
    return torch.matmul(seq_out, test_item_emb.transpose(0, 1))


# ---------------- reference: attention as a double loop over visible keys ----------------
def loop_attention(mha, input_tensor, input_ids):
    B, L, _ = input_tensor.shape
    H, D = mha.num_attention_heads, mha.attention_head_size
    q = mha.query(input_tensor).view(B, L, H, D)
    k = mha.key(input_tensor).view(B, L, H, D)
    v = mha.value(input_tensor).view(B, L, H, D)
    ctx = torch.zeros(B, L, H, D)
    for b in range(B):
        real = [j for j in range(L) if int(input_ids[b, j]) > 0]
        for i in range(L):
            keys = [j for j in real if j <= i]
            if not keys:  # a pad query: every key carries the same -10000, the softmax is over all of them
                keys = list(range(L))
            for h in range(H):
                s = torch.stack([(q[b, i, h] * k[b, j, h]).sum() / math.sqrt(D) for j in keys])
                p = torch.softmax(s, dim=0)
                ctx[b, i, h] = sum(p[n] * v[b, j, h] for n, j in enumerate(keys))
    hidden = mha.dense(ctx.reshape(B, L, H * D))
    return mha.LayerNorm(hidden + input_tensor)


def reference_forward(model, input_ids):
    hidden = model.add_position_embedding(input_ids)
    for block in model.item_encoder.blocks:
        layer = block.layer
        dsp = layer.filter_layer(hidden)
        gsp = loop_attention(layer.attention_layer, hidden, input_ids)
        hidden = block.feed_forward(layer.alpha * dsp + (1 - layer.alpha) * gsp)
    return hidden


def main():
    args = SimpleNamespace(
        item_size=21, hidden_size=16, num_attention_heads=2, num_hidden_layers=2, max_seq_length=8,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.02, batch_size=3,
        hidden_act="gelu", c=3, alpha=0.7,
    )
    model = BSARecModel(args)
    model.eval()

    user_seq = [
        [3, 7, 1, 12],                      # 3 history items + answer
        [5, 9, 2, 18, 4, 11, 6, 20, 13],     # longer than max_seq_length: truncated from the left
        [14, 8],                            # 1 history item
    ]
    batch = [rec_dataset_getitem(s, args.max_seq_length) for s in user_seq]
    input_ids = torch.stack([b[0] for b in batch])
    answers = torch.stack([b[1] for b in batch])
    user_ids = torch.arange(len(user_seq))
    print("input_ids\n", input_ids)

    with torch.no_grad():
        recommend_output = model.predict(input_ids, user_ids)
        recommend_output = recommend_output[:, -1, :]
        rating_pred = predict_full(model, recommend_output)
        loss = model.calculate_loss(input_ids, answers, None, None, user_ids)

        # every layer's attention against the double loop, on the layer's own input
        all_layers = model.forward(input_ids, all_sequence_output=True)
        mask = model.get_attention_mask(input_ids)
        for n, block in enumerate(model.item_encoder.blocks):
            got = block.layer.attention_layer(all_layers[n], mask)
            want = loop_attention(block.layer.attention_layer, all_layers[n], input_ids)
            err = (got - want).abs().max().item()
            print(f"layer {n}: attention vs double loop, max abs diff {err:.2e}")
            assert err < 1e-5

        ref_out = reference_forward(model, input_ids)[:, -1, :]
        ref_rating = predict_full(model, ref_out)
        ref_loss = nn.CrossEntropyLoss()(ref_rating, answers)

    err = (rating_pred - ref_rating).abs().max().item()
    print(f"full-sort scores vs reference, max abs diff {err:.2e}")
    print(f"loss {loss.item():.6f} reference {ref_loss.item():.6f}")
    assert err < 1e-5
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    print("top-3 items per user:", rating_pred.topk(3, dim=-1).indices.tolist())
    print("ok")


if __name__ == "__main__":
    main()
