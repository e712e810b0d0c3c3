# bigscience-workshop/Megatron-DeepSpeed PR #167 ("Fix prefix lm offsets", megatron/utils.py, pretrain_prefix_lm.py).
# Prefix indices were sampled in [0, seq_length-1] and the loss was masked over [:prefix_index], so the token at
# prefix_index is outside the bidirectional prefix yet never predicted; the fix samples [1, seq_length] and masks [:prefix_index-1].
import math
import random
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
random.seed(0)

EOD = 1
RESET_POSITION_IDS = False
RESET_ATTENTION_MASK = False
EOD_MASK_LOSS = False
LOSS_ON_TARGETS_ONLY = True


def get_prefix_indices(data, eod_token, partial_prefix_indices, reset_attention_mask):
    # per-row branch (reset_attention_mask=False)
    micro_batch_size, seq_length = data.size()
    prefix_indices = []
    for batch_id in range(micro_batch_size):
        if FIXED:
            if partial_prefix_indices is None or partial_prefix_indices[batch_id] is None:
                # 0 being the first prefix index makes no sense since 0 always attends to itself
                prefix_index = random.randint(1, seq_length)
            else:
                prefix_index = partial_prefix_indices[batch_id]
            assert 1 <= prefix_index <= seq_length
        else:
            if partial_prefix_indices is None or partial_prefix_indices[batch_id] is None:
                # We need to randomly generate a prefix index
                prefix_index = random.randint(0, seq_length - 1)
            else:
                prefix_index = partial_prefix_indices[batch_id]
                assert 0 <= prefix_index < seq_length - 1
        prefix_indices.append(prefix_index)
    return prefix_indices


def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss,
                                    prefix_indices, loss_on_targets_only):
    micro_batch_size, seq_length = data.size()
    if reset_attention_mask or prefix_indices is not None:
        att_mask_batch = micro_batch_size
    else:
        att_mask_batch = 1
    attention_mask = torch.tril(torch.ones(
        (att_mask_batch, seq_length, seq_length), device=data.device)).view(
            att_mask_batch, 1, seq_length, seq_length)
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    position_ids = position_ids.unsqueeze(0).expand_as(data)
    if reset_position_ids or reset_attention_mask or prefix_indices is not None:
        for b in range(micro_batch_size):
            # Prefix lm per row.
            if prefix_indices is not None and (reset_attention_mask is False):
                assert isinstance(prefix_indices[b], int)
                attention_mask[b, 0, :prefix_indices[b], :prefix_indices[b]] = 1
                if loss_on_targets_only:
                    if FIXED:
                        # Last token of the prefix should predict the prefix_index id
                        loss_mask[b, :prefix_indices[b] - 1] = 0.0
                    else:
                        loss_mask[b, :prefix_indices[b]] = 0.0
    # Convert attention mask to binary:
    attention_mask = (attention_mask < 0.5)
    return attention_mask, loss_mask, position_ids


def get_batch(tokens_):
    labels = tokens_[:, 1:].contiguous()
    tokens = tokens_[:, :-1].contiguous()
    prefix_indices = get_prefix_indices(tokens, EOD, partial_prefix_indices=None,
                                        reset_attention_mask=RESET_ATTENTION_MASK)
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, EOD, RESET_POSITION_IDS, RESET_ATTENTION_MASK, EOD_MASK_LOSS,
        prefix_indices=prefix_indices, loss_on_targets_only=LOSS_ON_TARGETS_ONLY)
    return tokens, labels, loss_mask, attention_mask, position_ids


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


class GPTModel(torch.nn.Module):
    # Megatron GPT, trimmed; torch-softmax path of FusedScaleMaskSoftmax
    def __init__(self, vocab=40, hidden=32, heads=4, layers=2, max_pos=32):
        super().__init__()
        self.heads = heads
        self.word_embeddings = torch.nn.Embedding(vocab, hidden)
        self.position_embeddings = torch.nn.Embedding(max_pos, hidden)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict(dict(
            input_layernorm=torch.nn.LayerNorm(hidden), query_key_value=torch.nn.Linear(hidden, 3 * hidden),
            dense=torch.nn.Linear(hidden, hidden), post_attention_layernorm=torch.nn.LayerNorm(hidden),
            dense_h_to_4h=torch.nn.Linear(hidden, 4 * hidden), dense_4h_to_h=torch.nn.Linear(4 * hidden, hidden)))
            for _ in range(layers))
        self.final_layernorm = torch.nn.LayerNorm(hidden)

    def forward(self, input_ids, position_ids, attention_mask, labels):
        h = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        b, s, d = h.shape
        hd = d // self.heads
        for layer in self.layers:
            x = layer["input_layernorm"](h)
            q, k, v = layer["query_key_value"](x).view(b, s, self.heads, 3 * hd).split(hd, dim=-1)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)
            probs = torch.softmax(attention_mask_func(scores, attention_mask), dim=-1)
            ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, d)
            h = h + layer["dense"](ctx)
            h = h + layer["dense_4h_to_h"](F.gelu(layer["dense_h_to_4h"](layer["post_attention_layernorm"](h))))
        logits = self.final_layernorm(h) @ self.word_embeddings.weight.t()
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")


model = GPTModel()
text = torch.randint(2, 40, (4, 17))
tokens, labels, loss_mask, attention_mask, position_ids = get_batch(text)
losses = model(tokens, position_ids, attention_mask, labels)
loss = torch.sum(losses.view(-1) * loss_mask.reshape(-1)) / loss_mask.sum()
loss.backward()

# token j of `tokens` is either inside the bidirectional prefix (it sees itself from every earlier query) or must be
# a training target (label of position j-1); count the tokens that are neither
b, s = tokens.shape
in_prefix = ~attention_mask[:, 0, 0, :]                              # row 0 sees column j only if j is in the prefix
is_target = torch.zeros(b, s, dtype=torch.bool)
is_target[:, 1:] = loss_mask[:, :-1].bool()
orphans = (~in_prefix & ~is_target)[:, 1:].sum().item()
print(f"tokens neither in the bidirectional prefix nor predicted: {orphans}  prefix-lm loss: {loss.item():.6f}")
