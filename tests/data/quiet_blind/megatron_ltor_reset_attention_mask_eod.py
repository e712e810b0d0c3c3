"""Megatron-LM GPT pretraining batch with --reset-attention-mask / --reset-position-ids on EOD tokens.

Follows megatron/training/utils.py get_ltor_masks_and_position_ids (lower-triangular attention_mask,
zeroed `attention_mask[b, 0, (i + 1):, :(i + 1)]` after every EOD, position_ids restarted after EOD,
then `attention_mask = (attention_mask < 0.5)`) and megatron/core/fusions/fused_softmax.py with
megatron/core/transformer/utils.py attention_mask_func (`attention_scores.masked_fill_(attention_mask,
-10000.0)`). NOTE Megatron's bool convention: True means "masked out". The mask is block-diagonal causal
over the documents packed in each sample (the EOD token closes its document and belongs to it).
"""
import argparse
import math

import torch
import torch.nn as nn


def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    micro_batch_size, seq_length = data.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_mask_batch, seq_length, seq_length))).view(att_mask_batch, 1, seq_length, seq_length)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod_token]
            if reset_position_ids:
                eod_index = eod_index.clone()
            prev_index = 0
            for j in range(eod_index.size()[0]):  # loop over documents, not tokens
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1):, :(i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1):] -= i + 1 - prev_index
                    prev_index = i + 1
    attention_mask = attention_mask < 0.5  # convert to binary: True = masked
    return attention_mask, loss_mask, position_ids


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


class CoreAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads):
        super().__init__()
        self.hidden_size_per_attention_head = hidden_size // num_attention_heads
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        # [sq, b, np, hn] layout as in megatron
        sq, b, np_, hn = query_layer.shape
        q = query_layer.permute(1, 2, 0, 3)
        k = key_layer.permute(1, 2, 0, 3)
        v = value_layer.permute(1, 2, 0, 3)
        attention_scores = torch.matmul(q, k.transpose(-2, -1)) / self.norm_factor
        attention_probs = torch.softmax(attention_mask_func(attention_scores, attention_mask), dim=-1)
        context = torch.matmul(attention_probs, v)  # b, np, sq, hn
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


class ParallelAttention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.np = args.num_attention_heads
        self.query_key_value = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.core_attention = CoreAttention(args.hidden_size, args.num_attention_heads)
        self.dense = nn.Linear(args.hidden_size, args.hidden_size)

    def forward(self, hidden_states, attention_mask):
        sq, b, h = hidden_states.shape
        mixed = self.query_key_value(hidden_states).view(sq, b, self.np, 3 * h // self.np)
        q, k, v = torch.split(mixed, h // self.np, dim=3)
        return self.dense(self.core_attention(q, k, v, attention_mask))


class GPTModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.padded_vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_position_embeddings, args.hidden_size)
        self.layers = nn.ModuleList([ParallelAttention(args) for _ in range(args.num_layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(args.hidden_size) for _ in range(args.num_layers)])
        self.output = nn.Linear(args.hidden_size, args.padded_vocab_size, bias=False)

    def forward(self, input_ids, position_ids, attention_mask):
        h = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)).transpose(0, 1)
        for norm, layer in zip(self.norms, self.layers):
            h = h + layer(norm(h), attention_mask)
        return self.output(h).transpose(0, 1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=32)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=16)
    parser.add_argument("--max-position-embeddings", type=int, default=16)
    parser.add_argument("--padded-vocab-size", type=int, default=64)
    parser.add_argument("--reset-position-ids", action="store_true", default=True)
    parser.add_argument("--reset-attention-mask", action="store_true", default=True)
    parser.add_argument("--eod-mask-loss", action="store_true", default=False)
    args = parser.parse_args([])
    torch.manual_seed(0)
    eod = 0
    tokens_ = torch.randint(1, args.padded_vocab_size, (2, args.seq_length + 1))
    tokens_[0, [4, 11]] = eod
    tokens_[1, [7]] = eod
    tokens, labels = tokens_[:, :-1].contiguous(), tokens_[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
    model = GPTModel(args).eval()
    with torch.no_grad():
        logits = model(tokens, position_ids, attention_mask)
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, args.padded_vocab_size), labels.view(-1), reduction="none")
    loss = torch.sum(losses * loss_mask.view(-1)) / loss_mask.sum()
    print("position_ids", position_ids[0].tolist())
    print(f"lm loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
