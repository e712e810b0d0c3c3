# Correct program (quiet batch quiet-r102b).
# Ported from yehjin-shin/BSARec: src/model/bert4rec.py @b9d056b3a785614e797a251d728f770f0ea68729 (BERT4RecModel.forward,
# predict, reconstruct_test_data), src/model/_abstract_model.py @704a0d1d7cebf7ce7c8d7cbf01b9b6bd01797180
# (SequentialRecModel.add_position_embedding, get_bi_attention_mask), src/model/_modules.py (MultiHeadAttention,
# TransformerBlock, TransformerEncoder, FeedForward), src/dataset.py (RecDataset.__getitem__: histories LEFT-padded
# with item 0), src/trainers.py (evaluation reads recommend_output[:, -1, :], predict_full scores every item).
# BERT4Rec evaluation: reconstruct_test_data drops the first column and appends the mask token (id item_size) at the
# end, so the [MASK] sits in the last, always real, slot; the encoder is bidirectional and its extended mask
# (1 - (ids > 0)) * -10000 hides the pad keys (the mask token's id is > 0, so it is a key like any item).
# The check: each user's real slots run alone (no padding, no mask, same position ids) give the same hidden states
# at every real slot and the same full-sort scores from the [MASK] slot.
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



class TransformerBlock(nn.Module):
    def __init__(self, args):
        super(TransformerBlock, self).__init__()
        self.layer = MultiHeadAttention(args)
        self.feed_forward = FeedForward(args)

    def forward(self, hidden_states, attention_mask):
        layer_output = self.layer(hidden_states, attention_mask)
        feedforward_output = self.feed_forward(layer_output)
        return feedforward_output


class TransformerEncoder(nn.Module):
    def __init__(self, args):
        super(TransformerEncoder, self).__init__()
        self.args = args
        block = TransformerBlock(args)  # self attention
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

    def get_bi_attention_mask(self, item_seq):
        """Generate bidirectional attention mask for multi-head attention."""
        attention_mask = (item_seq > 0).long()
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)  # torch.int64

        # bidirectional mask
        extended_attention_mask = extended_attention_mask.to(dtype=next(self.parameters()).dtype)  # fp16 compatibility
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        return extended_attention_mask

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


class BERT4RecModel(SequentialRecModel):
    def __init__(self, args):
        super(BERT4RecModel, self).__init__(args)

        # load parameters info
        self.mask_ratio = args.mask_ratio
        self.max_seq_length = args.max_seq_length
        self.item_embeddings = nn.Embedding(args.item_size + 1, args.hidden_size, padding_idx=0)

        # load dataset info
        self.mask_token = args.item_size
        self.n_items = args.item_size
        self.mask_item_length = int(self.mask_ratio * self.max_seq_length)

        # define layers and loss
        self.item_encoder = TransformerEncoder(args)

        self.LayerNorm = LayerNorm(args.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(args.hidden_dropout_prob)

        # parameters initialization
        self.apply(self.init_weights)

    def forward(self, input_ids, user_ids=None, all_sequence_output=False):
        extended_attention_mask = self.get_bi_attention_mask(input_ids)
        sequence_emb = self.add_position_embedding(input_ids)
        item_encoded_layers = self.item_encoder(sequence_emb, extended_attention_mask,
                                                output_all_encoded_layers=True)
        if all_sequence_output:
            sequence_output = item_encoded_layers
        else:
            sequence_output = item_encoded_layers[-1]
        return sequence_output

    def predict(self, input_ids, user_ids, all_sequence_output=False):
        item_seq = self.reconstruct_test_data(input_ids)
        seq_output = self.forward(item_seq)
        return seq_output

    def reconstruct_test_data(self, item_seq):
        """
        Add mask token at the last position according to the lengths of item_seq
        """
        padding = self.mask_token * torch.ones(item_seq.size(0), dtype=torch.long, device=item_seq.device)  # [B]
        item_seq = torch.cat((item_seq, padding.unsqueeze(-1)), dim=-1)  # [B max_len+1]
        item_seq = item_seq[:, 1:]
        return item_seq


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


def reference_user(model, row_ids):
    # one user alone: only its real slots, each keeping its position id, no padding and no mask at all
    slots = (row_ids > 0).nonzero().flatten()
    ids = row_ids[slots].unsqueeze(0)
    emb = model.item_embeddings(ids) + model.position_embeddings(slots.unsqueeze(0))
    hidden = model.dropout(model.LayerNorm(emb))
    no_mask = torch.zeros(1, 1, 1, ids.size(1))
    for block in model.item_encoder.blocks:
        hidden = block(hidden, no_mask)
    return slots, hidden[0]


def main():
    args = SimpleNamespace(
        item_size=21, hidden_size=16, num_attention_heads=2, num_hidden_layers=2, max_seq_length=8,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.02, batch_size=3,
        hidden_act="gelu", mask_ratio=0.2,
    )
    model = BERT4RecModel(args)
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

    with torch.no_grad():
        item_seq = model.reconstruct_test_data(input_ids)
        print("reconstructed test ids\n", item_seq)
        full_output = model.predict(input_ids, user_ids)
        recommend_output = full_output[:, -1, :]
        rating_pred = predict_full(model, recommend_output)

        worst = 0.0
        for b in range(item_seq.size(0)):
            slots, ref_hidden = reference_user(model, item_seq[b])
            err = (full_output[b, slots] - ref_hidden).abs().max().item()
            worst = max(worst, err)
            ref_rating = predict_full(model, ref_hidden[-1:])
            err_r = (rating_pred[b:b + 1] - ref_rating).abs().max().item()
            print(f"user {b}: {len(slots)} real slots, hidden diff {err:.2e}, score diff {err_r:.2e}")
            assert err < 1e-5 and err_r < 1e-5
        loss = nn.CrossEntropyLoss()(rating_pred[:, : model.n_items], answers)

    print(f"max hidden diff {worst:.2e}; eval CE over items {loss.item():.6f}")
    print("top-3 items per user:", rating_pred[:, : model.n_items].topk(3, dim=-1).indices.tolist())
    print("ok")


if __name__ == "__main__":
    main()
