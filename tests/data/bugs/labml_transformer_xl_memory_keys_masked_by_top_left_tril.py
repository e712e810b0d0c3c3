# labmlai/annotated_deep_learning_paper_implementations commit 1f38b23 ("fixes"), labml_nn/transformers/xl:
# Transformer XL's AutoregressiveModel built one subsequent_mask over len(x) + len(mem) and sliced its first len(x)
# rows, while TransformerXLLayer concatenated the keys as (z, mem). Query i could see keys 0..i only, so the memory
# of the previous segment was never attended. The fix puts the memory first, cat((mem, z)), builds the mask as
# [ones(len(x), m_len) | subsequent_mask(len(x))], and slices the relative position embeddings by key length.
# Layout as the project writes it: seq-first tensors [seq_len, batch, d_model], mask[i, j, b].
import copy
import math
import sys
from typing import List, Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def subsequent_mask(seq_len):
    """labml_nn/transformers/utils.py"""
    mask = torch.tril(torch.ones(seq_len, seq_len)).to(torch.bool).unsqueeze(-1)
    return mask


def clone_module_list(module: nn.Module, n: int):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.1, activation=nn.ReLU()):
        super().__init__()
        self.layer1 = nn.Linear(d_model, d_ff)
        self.layer2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)
        self.activation = activation

    def forward(self, x: torch.Tensor):
        g = self.activation(self.layer1(x))
        x = self.dropout(g)
        return self.layer2(x)


class PrepareForMultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, d_k: int, bias: bool):
        super().__init__()
        self.linear = nn.Linear(d_model, heads * d_k, bias=bias)
        self.heads = heads
        self.d_k = d_k

    def forward(self, x: torch.Tensor):
        head_shape = x.shape[:-1]
        x = self.linear(x)
        x = x.view(*head_shape, self.heads, self.d_k)
        return x


class MultiHeadAttention(nn.Module):
    """labml_nn/transformers/mha.py"""

    def __init__(self, heads: int, d_model: int, dropout_prob: float = 0.1, bias: bool = True):
        super().__init__()
        self.d_k = d_model // heads
        self.heads = heads
        self.query = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.key = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.value = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=True)
        self.softmax = nn.Softmax(dim=1)
        self.output = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout_prob)
        self.scale = 1 / math.sqrt(self.d_k)
        self.attn = None

    def get_scores(self, query: torch.Tensor, key: torch.Tensor):
        return torch.einsum('ibhd,jbhd->ijbh', query, key)

    def forward(self, *, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: Optional[torch.Tensor] = None):
        seq_len, batch_size, _ = query.shape
        if mask is not None:
            assert mask.shape[0] == 1 or mask.shape[0] == query.shape[0]
            assert mask.shape[1] == key.shape[0]
            assert mask.shape[2] == 1 or mask.shape[2] == query.shape[1]
            mask = mask.unsqueeze(-1)
        query = self.query(query)
        key = self.key(key)
        value = self.value(value)
        scores = self.get_scores(query, key)
        scores *= self.scale
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attn = self.softmax(scores)
        attn = self.dropout(attn)
        x = torch.einsum("ijbh,jbhd->ibhd", attn, value)
        self.attn = attn.detach()
        x = x.reshape(seq_len, batch_size, -1)
        return self.output(x)


def shift_right(x: torch.Tensor):
    zero_pad = x.new_zeros(x.shape[0], 1, *x.shape[2:])
    x_padded = torch.cat([x, zero_pad], dim=1)
    x_padded = x_padded.view(x.shape[1] + 1, x.shape[0], *x.shape[2:])
    x = x_padded[:-1].view_as(x)
    return x


class RelativeMultiHeadAttention(MultiHeadAttention):
    """labml_nn/transformers/xl/relative_mha.py"""

    def __init__(self, heads: int, d_model: int, dropout_prob: float = 0.1):
        super().__init__(heads, d_model, dropout_prob, bias=False)
        self.P = 2 ** 12
        self.key_pos_embeddings = nn.Parameter(torch.zeros((self.P * 2, heads, self.d_k)), requires_grad=True)
        self.key_pos_bias = nn.Parameter(torch.zeros((self.P * 2, heads)), requires_grad=True)
        self.query_pos_bias = nn.Parameter(torch.zeros((heads, self.d_k)), requires_grad=True)

    def get_scores(self, query: torch.Tensor, key: torch.Tensor):
        if FIXED:
            key_pos_emb = self.key_pos_embeddings[self.P - key.shape[0]:self.P + query.shape[0]]
            key_pos_bias = self.key_pos_bias[self.P - key.shape[0]:self.P + query.shape[0]]
        else:
            key_pos_emb = self.key_pos_embeddings[self.P - query.shape[0]:self.P + key.shape[0]]
            key_pos_bias = self.key_pos_bias[self.P - query.shape[0]:self.P + key.shape[0]]
        query_pos_bias = self.query_pos_bias[None, None, :, :]
        ac = torch.einsum('ibhd,jbhd->ijbh', query + query_pos_bias, key)
        b = torch.einsum('ibhd,jhd->ijbh', query, key_pos_emb)
        d = key_pos_bias[None, :, None, :]
        bd = shift_right(b + d)
        bd = bd[:, -key.shape[0]:]
        return ac + bd


class TransformerXLLayer(nn.Module):
    def __init__(self, *, d_model: int, self_attn: RelativeMultiHeadAttention, feed_forward: FeedForward,
                 dropout_prob: float):
        super().__init__()
        self.size = d_model
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.dropout = nn.Dropout(dropout_prob)
        self.norm_self_attn = nn.LayerNorm([d_model])
        self.norm_ff = nn.LayerNorm([d_model])

    def forward(self, *, x: torch.Tensor, mem: Optional[torch.Tensor], mask: torch.Tensor):
        z = self.norm_self_attn(x)
        if mem is not None:
            mem = self.norm_self_attn(mem)
            if FIXED:
                zm = torch.cat((mem, z), dim=0)
            else:
                zm = torch.cat((z, mem), dim=0)
        else:
            zm = z
        self_attn = self.self_attn(query=z, key=zm, value=zm, mask=mask)
        x = x + self.dropout(self_attn)
        z = self.norm_ff(x)
        ff = self.feed_forward(z)
        x = x + self.dropout(ff)
        return x


class TransformerXL(nn.Module):
    def __init__(self, layer: TransformerXLLayer, n_layers: int):
        super().__init__()
        self.layers = clone_module_list(layer, n_layers)
        self.norm = nn.LayerNorm([layer.size])

    def forward(self, x: torch.Tensor, mem: List[torch.Tensor], mask: torch.Tensor):
        new_mem = []
        for i, layer in enumerate(self.layers):
            new_mem.append(x.detach())
            m = mem[i] if mem else None
            x = layer(x=x, mem=m, mask=mask)
        return self.norm(x), new_mem


class AutoregressiveModel(nn.Module):
    """labml_nn/transformers/xl/experiment.py"""

    def __init__(self, n_vocab: int, d_model: int, transformer: TransformerXL):
        super().__init__()
        self.src_embed = nn.Embedding(n_vocab, d_model)
        self.transformer = transformer
        self.generator = nn.Linear(d_model, n_vocab)
        self.mask = None
        self.mask_x = None
        self.mask_mem = None

    def forward(self, x: torch.Tensor, mem: List[torch.Tensor]):
        if FIXED:
            m_len = len(mem[0]) if mem else 0
            if self.mask_x is None or self.mask_x.shape[0] < len(x):
                self.mask_x = subsequent_mask(len(x)).to(x.device)
            if self.mask_mem is None or self.mask_mem.shape[1] < m_len or self.mask_mem.shape[0] < len(x):
                self.mask_mem = self.mask_x.new_ones(len(x), m_len, 1)
            if m_len:
                mask = torch.cat((self.mask_mem[:len(x), :m_len], self.mask_x[:len(x), :len(x)]), dim=1)
            else:
                mask = self.mask_x[:len(x), :len(x)]
        else:
            length = len(x)
            if mem:
                length += len(mem[0])
            if self.mask is None or self.mask.size(0) != length:
                self.mask = subsequent_mask(length).to(x.device)
            mask = self.mask[:len(x), :length, :]
        x = self.src_embed(x)
        res, mem = self.transformer(x, mem, mask)
        res = self.generator(res)
        return res, mem


class Configs:
    n_tokens = 65
    d_model = 32
    heads = 4
    dropout = 0.0
    d_ff = 64
    n_layers = 2
    seq_len = 8
    batch_size = 2
    mem_len = 16


def merge_memory(c: Configs, old_mem, new_mem):
    if c.mem_len == 0:
        return []
    if old_mem:
        mem = [torch.cat((m, x), dim=0) for m, x in zip(old_mem, new_mem)]
    else:
        mem = new_mem
    if len(mem[0]) > c.mem_len:
        mem = [m[-c.mem_len:] for m in mem]
    return mem


def autoregressive_model(c: Configs):
    m = AutoregressiveModel(c.n_tokens, c.d_model, TransformerXL(
        TransformerXLLayer(d_model=c.d_model,
                           self_attn=RelativeMultiHeadAttention(c.heads, c.d_model, c.dropout),
                           feed_forward=FeedForward(c.d_model, c.d_ff, c.dropout),
                           dropout_prob=c.dropout), c.n_layers))
    return m


def main():
    c = Configs()
    model = autoregressive_model(c)
    model.eval()
    # sequential_train_loader: consecutive segments of one text, [seq_len, batch_size]
    text = torch.randint(0, c.n_tokens, (3 * c.seq_len + 1, c.batch_size))
    loss_func = nn.CrossEntropyLoss()
    mem = []
    with torch.no_grad():
        for step in range(3):
            data = text[step * c.seq_len:(step + 1) * c.seq_len]
            target = text[step * c.seq_len + 1:(step + 1) * c.seq_len + 1]
            output, new_mem = model(data, mem)
            if FIXED:
                mem = merge_memory(c, mem, new_mem)
            else:
                mem = new_mem
            loss = loss_func(output.view(-1, output.shape[-1]), target.view(-1))
            print(f"segment {step}: mem_len={len(mem[0])} loss={loss.item():.6f} "
                  f"logit[0,0,:3]={output[0, 0, :3].tolist()}")


if __name__ == "__main__":
    main()
