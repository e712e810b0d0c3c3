"""DI-engine's entity Transformer built the padding mask and then threw it away (non in-place fill).

Citation: opendilab/DI-engine#333 ("Is it a bug about transformer mask?", closed), fixed by commit
dc064896e164cae1061db8b1ffe7cd084a0aed1f ("fix(nyz): fix transformer mask bug").  Source read:
ding/torch_utils/network/transformer.py before and after that commit.

Bug: `Transformer.forward` takes a (B, N) bool `mask` of valid entries and expands it to
(B, 1, N, N); `Attention.forward` then did `score.masked_fill(~mask, value=-1e9)` — the
out-of-place variant, whose result is discarded — so softmax ran over every entry, padding
entries included.  (The maintainers note GTrXL never passed variable-length masks, so only the
entity-encoder style use was affected.)
Fix (dc06489): `score.masked_fill_(~mask, value=-1e9)`.

Reproduction: the DI-engine Transformer (embedding fc_block, 2 TransformerLayers, 2 heads) over
a batch of 2 entity sets of 6 slots, with 6 and 3 valid entities.  fc_block / build_normalization
are written out as Linear(+activation) / LayerNorm.
"""
import math
import sys
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def fc_block(in_channels, out_channels, activation=None):
    block = [nn.Linear(in_channels, out_channels)]
    if activation is not None:
        block.append(activation)
    return nn.Sequential(*block)


class Attention(nn.Module):
    def __init__(self, input_dim: int, head_dim: int, output_dim: int, head_num: int, dropout: nn.Module) -> None:
        super(Attention, self).__init__()
        self.head_num = head_num
        self.head_dim = head_dim
        self.dropout = dropout
        self.attention_pre = fc_block(input_dim, head_dim * head_num * 3)  # query, key, value
        self.project = fc_block(head_dim * head_num, output_dim)

    def split(self, x: torch.Tensor, T: bool = False) -> List[torch.Tensor]:
        B, N = x.shape[:2]
        x = x.view(B, N, self.head_num, self.head_dim)
        x = x.permute(0, 2, 1, 3).contiguous()  # B, head_num, N, head_dim
        if T:
            x = x.permute(0, 1, 3, 2).contiguous()
        return x

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        assert (len(x.shape) == 3)
        B, N = x.shape[:2]
        x = self.attention_pre(x)
        query, key, value = torch.chunk(x, 3, dim=2)
        query, key, value = self.split(query), self.split(key, T=True), self.split(value)

        score = torch.matmul(query, key)  # B, head_num, N, N
        score /= math.sqrt(self.head_dim)
        if mask is not None:
            if FIXED:
                # inplace modification for reasonable softmax
                score.masked_fill_(~mask, value=-1e9)
            else:
                score.masked_fill(~mask, value=-1e9)

        score = F.softmax(score, dim=-1)
        score = self.dropout(score)
        attention = torch.matmul(score, value)  # B, head_num, N, head_dim

        attention = attention.permute(0, 2, 1, 3).contiguous()  # B, N, head_num, head_dim
        attention = self.project(attention.view(B, N, -1))  # B, N, output_dim
        return attention


class TransformerLayer(nn.Module):
    def __init__(self, input_dim: int, head_dim: int, hidden_dim: int, output_dim: int, head_num: int,
                 mlp_num: int, dropout: nn.Module, activation: nn.Module) -> None:
        super(TransformerLayer, self).__init__()
        self.attention = Attention(input_dim, head_dim, output_dim, head_num, dropout)
        self.layernorm1 = nn.LayerNorm(output_dim)
        self.dropout = dropout
        layers = []
        dims = [output_dim] + [hidden_dim] * (mlp_num - 1) + [output_dim]
        for i in range(mlp_num):
            layers.append(fc_block(dims[i], dims[i + 1], activation=activation))
            if i != mlp_num - 1:
                layers.append(self.dropout)
        layers.append(self.dropout)
        self.mlp = nn.Sequential(*layers)
        self.layernorm2 = nn.LayerNorm(output_dim)

    def forward(self, inputs: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        x, mask = inputs
        a = self.dropout(self.attention(x, mask))
        x = self.layernorm1(x + a)
        m = self.dropout(self.mlp(x))
        x = self.layernorm2(x + m)
        return (x, mask)


class Transformer(nn.Module):
    def __init__(self, input_dim: int, head_dim: int = 128, hidden_dim: int = 1024, output_dim: int = 256,
                 head_num: int = 2, mlp_num: int = 2, layer_num: int = 3, dropout_ratio: float = 0.,
                 activation: nn.Module = nn.ReLU()):
        super(Transformer, self).__init__()
        self.embedding = fc_block(input_dim, output_dim, activation=activation)
        self.act = activation
        layers = []
        dims = [output_dim] + [output_dim] * layer_num
        self.dropout = nn.Dropout(dropout_ratio)
        for i in range(layer_num):
            layers.append(
                TransformerLayer(dims[i], head_dim, hidden_dim, dims[i + 1], head_num, mlp_num, self.dropout, self.act)
            )
        self.main = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """mask: bool (B, N), True on valid entries; used to mask out invalid entries in attention."""
        if mask is not None:
            mask = mask.unsqueeze(dim=1).repeat(1, mask.shape[1], 1).unsqueeze(dim=1)
        x = self.embedding(x)
        x = self.dropout(x)
        x, mask = self.main((x, mask))
        return x


if __name__ == "__main__":
    torch.manual_seed(0)
    model = Transformer(input_dim=10, head_dim=16, hidden_dim=64, output_dim=32, head_num=2, layer_num=2).eval()
    entities = torch.randn(2, 6, 10)
    entity_num = torch.tensor([6, 3])
    mask = torch.arange(6)[None, :] < entity_num[:, None]
    with torch.no_grad():
        out = model(entities, mask)
    print("valid entities of set 1, first feature:", [round(v, 4) for v in out[1, :3, 0].tolist()])
