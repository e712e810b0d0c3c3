# bigcode-project/Megatron-LM commit 324d70d ("Fix decoder-only attention mask shape", pretrain_ul2.py): the decoder-only
# UL2 / prefix-LM batch mask dec_mask [b, s, s] reached the attention scores [b, np, s, s] without a head axis, so
# masked_fill_ broadcast it along the heads: head h got sample h's prefix-LM mask instead of its own sample's.
import sys
import math
import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

HIDDEN, NP, LAYERS, VOCAB, SEQ = 64, 2, 2, 40, 16
PAD, BOS, SEP, EOS = 0, 1, 2, 3


# megatron/data/t5_dataset.py
def make_history_mask(block):
    length = block.shape[0]
    arange = np.arange(length)
    history_mask = (arange[None, ] <= arange[:, None])
    history_mask = history_mask.astype(np.int64)
    return history_mask


# megatron/data/ul2_dataset.py, decoder-only + prefix-LM branch of build_training_sample (after span corruption)
def build_training_sample(tokens_enc, labels_in, max_seq_length):
    num_labels = len(labels_in)
    tokens_dec_in = labels_in[:-1]
    tokens = [BOS] + tokens_enc + [SEP] + tokens_dec_in
    padding_length = max_seq_length - len(tokens)
    filler = [PAD] * padding_length
    tokens = np.array(tokens + filler, dtype=np.int64)
    labels = np.array(tokens_enc + [SEP] + labels_in + filler, dtype=np.int64)
    loss_mask = np.zeros(len(tokens), dtype=np.int64)
    labels_start_neg_index = -(num_labels + padding_length)
    labels_end_neg_index = -padding_length if padding_length > 0 else None
    loss_mask[labels_start_neg_index:labels_end_neg_index] = 1
    dec_mask = make_history_mask(tokens)
    dec_mask[:labels_start_neg_index, :labels_start_neg_index] = 1  # is_prefix_lm
    return {'text': tokens, 'labels': labels, 'loss_mask': loss_mask, 'dec_mask': dec_mask}


# pretrain_ul2.py
def get_batch(data_b):
    tokens = data_b['text'].long()
    labels = data_b['labels'].long()
    loss_mask = data_b['loss_mask'].float()
    dec_mask = (data_b['dec_mask'] < 0.5)
    if FIXED:
        dec_mask = dec_mask.unsqueeze(1)
    return tokens, loss_mask, labels, dec_mask


# megatron/model/utils.py
def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


class FusedScaleMaskSoftmax(nn.Module):  # unfused torch path
    def __init__(self, mask_func, scale):
        super().__init__()
        self.mask_func = mask_func
        self.scale = scale

    def forward(self, input, mask):
        if self.scale is not None:
            input = input * self.scale
        mask_output = self.mask_func(input, mask) if mask is not None else input
        return torch.nn.Softmax(dim=-1)(mask_output)


class ParallelAttention(nn.Module):
    def __init__(self, layer_number):
        super().__init__()
        self.hidden_size_per_attention_head = HIDDEN // NP
        self.num_attention_heads_per_partition = NP
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        self.query_key_value = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.scale_mask_softmax = FusedScaleMaskSoftmax(attention_mask_func, None)
        self.dense = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states, attention_mask):
        # hidden_states: [sq, b, h]
        mixed_x_layer = self.query_key_value(hidden_states)
        new_shape = mixed_x_layer.size()[:-1] + (NP, 3 * self.hidden_size_per_attention_head)
        mixed_x_layer = mixed_x_layer.view(*new_shape)
        query_layer, key_layer, value_layer = torch.split(mixed_x_layer, self.hidden_size_per_attention_head, dim=3)
        # [b, np, sq, sk]
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))
        query_layer = query_layer.reshape(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.reshape(output_size[3], output_size[0] * output_size[1], -1)
        matmul_input_buffer = torch.empty(output_size[0] * output_size[1], output_size[2], output_size[3])
        matmul_result = torch.baddbmm(matmul_input_buffer, query_layer.transpose(0, 1),
                                      key_layer.transpose(0, 1).transpose(1, 2), beta=0.0,
                                      alpha=(1.0 / self.norm_factor))
        attention_scores = matmul_result.view(*output_size)
        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)
        output_size = (value_layer.size(1), value_layer.size(2), query_layer.size(0), value_layer.size(3))
        value_layer = value_layer.reshape(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(*output_size).permute(2, 0, 1, 3).contiguous()
        context_layer = context_layer.view(*context_layer.size()[:-2], HIDDEN)
        return self.dense(context_layer)


class ParallelTransformerLayer(nn.Module):
    def __init__(self, layer_number):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attention = ParallelAttention(layer_number)
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, hidden_states, attention_mask):
        h = hidden_states + self.self_attention(self.input_layernorm(hidden_states), attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class GPTModel(nn.Module):  # prefix_lm=True, decoder-only UL2
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)
        self.layers = nn.ModuleList([ParallelTransformerLayer(i + 1) for i in range(LAYERS)])
        self.final_layernorm = nn.LayerNorm(HIDDEN)

    def forward(self, input_ids, position_ids, attention_mask, labels):
        h = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)).transpose(0, 1)  # [s, b, h]
        for layer in self.layers:
            h = layer(h, attention_mask)
        logits = self.final_layernorm(h).transpose(0, 1) @ self.word_embeddings.weight.t()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction='none').view_as(labels), logits


def t5_position_ids(tokens):
    return torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)


rng = np.random.RandomState(0)
samples = [
    build_training_sample(list(rng.randint(4, VOCAB, 9)), list(rng.randint(4, VOCAB, 3)) + [EOS], SEQ),   # long prefix
    build_training_sample(list(rng.randint(4, VOCAB, 3)), list(rng.randint(4, VOCAB, 6)) + [EOS], SEQ),   # short prefix + pad
]
model = GPTModel().eval()
for emb in (model.word_embeddings, model.position_embeddings):
    nn.init.normal_(emb.weight, std=0.02)  # init_method_normal(args.init_method_std)


def collate(ss):
    return {k: torch.from_numpy(np.stack([s[k] for s in ss])) for k in ss[0]}


with torch.no_grad():
    tokens, loss_mask, labels, dec_mask = get_batch(collate(samples))
    losses, logits = model(tokens, t5_position_ids(tokens), dec_mask, labels)
    worst = 0.0
    for i, s in enumerate(samples):
        t1, lm1, lb1, m1 = get_batch(collate([s]))
        _, logit1 = model(t1, t5_position_ids(t1), m1, lb1)
        valid = t1[0] != PAD
        worst = max(worst, (logits[i][valid] - logit1[0][valid]).abs().max().item())
    loss = (losses.view(-1) * loss_mask.reshape(-1)).sum() / loss_mask.sum()
print(f"batch lm loss = {loss.item():.6f}")
print(f"max |batched logits - per-sample logits| = {worst:.6f}")
