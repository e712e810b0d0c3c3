# Citation: opendilab/DI-engine#333, fixed by commit dc064896e164cae1061db8b1ffe7cd084a0aed1f
#   ("fix(nyz): fix transformer mask bug"); buggy state read at dc064896^.
# Upstream: ding/torch_utils/network/transformer.py -- Attention.forward, TransformerLayer,
#   Transformer.forward (the entity transformer exported as ding.torch_utils.Transformer, with
#   fc_block / build_normalization from ding/torch_utils/network/nn_module.py).
# Bug: Attention.forward called `score.masked_fill(~mask, value=-1e9)` and threw the result away
#   (out-of-place op), so the (B, N) "valid entries" mask given to Transformer.forward never
#   reached the softmax: every entity attended to the padded entity slots as well.
# Fix: `score.masked_fill_(~mask, value=-1e9)` (in place), so the masked scores feed the softmax.
#
# Here: a multi-agent / entity-observation Q-network encodes a padded set of units (each sample
# has a different number of live units; the rest of the slots are zero-filled), runs the DI-engine
# Transformer with the valid-entity mask, pools over the valid units and scores actions.
import math
import sys
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---- ding/torch_utils/network/nn_module.py (the parts used) ----
def sequential_pack(layers: list) -> nn.Sequential:
    return nn.Sequential(*layers)


def fc_block(in_channels: int, out_channels: int, activation: nn.Module = None, norm_type: str = None,
             use_dropout: bool = False, dropout_probability: float = 0.5) -> nn.Sequential:
    block = []
    block.append(nn.Linear(in_channels, out_channels))
    if norm_type is not None:
        block.append(build_normalization(norm_type, dim=1)(out_channels))
    if activation is not None:
        block.append(activation)
    if use_dropout:
        block.append(nn.Dropout(dropout_probability))
    return sequential_pack(block)


def build_normalization(norm_type: str, dim: Optional[int] = None) -> nn.Module:
    if norm_type == 'LN':
        return nn.LayerNorm
    raise KeyError(norm_type)


# ---- ding/torch_utils/network/transformer.py ----
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
        self.layernorm1 = build_normalization('LN')(output_dim)
        self.dropout = dropout
        layers = []
        dims = [output_dim] + [hidden_dim] * (mlp_num - 1) + [output_dim]
        for i in range(mlp_num):
            layers.append(fc_block(dims[i], dims[i + 1], activation=activation))
            if i != mlp_num - 1:
                layers.append(self.dropout)
        layers.append(self.dropout)
        self.mlp = nn.Sequential(*layers)
        self.layernorm2 = build_normalization('LN')(output_dim)

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
        # mask: bool (B, N), True = valid entry
        if mask is not None:
            mask = mask.unsqueeze(dim=1).repeat(1, mask.shape[1], 1).unsqueeze(dim=1)
        x = self.embedding(x)
        x = self.dropout(x)
        x, mask = self.main((x, mask))
        return x


# ---- a small entity-based Q network on top of it ----
class EntityQNet(nn.Module):

    def __init__(self, entity_dim: int, action_num: int):
        super().__init__()
        self.encoder = Transformer(input_dim=entity_dim, head_dim=8, hidden_dim=32, output_dim=16,
                                   head_num=2, mlp_num=2, layer_num=2, dropout_ratio=0.)
        self.head = nn.Linear(16, action_num)

    def forward(self, entities: torch.Tensor, entity_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(entities, entity_mask)  # B, N, 16
        m = entity_mask.unsqueeze(-1).float()
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1.0)
        return self.head(pooled)


def collate_units(unit_lists, max_units):
    B = len(unit_lists)
    C = unit_lists[0].shape[-1]
    entities = torch.zeros(B, max_units, C)
    mask = torch.zeros(B, max_units, dtype=torch.bool)
    for b, u in enumerate(unit_lists):
        entities[b, :u.shape[0]] = u
        mask[b, :u.shape[0]] = True
    return entities, mask


def main():
    torch.manual_seed(0)
    entity_dim, action_num, max_units = 6, 5, 8
    model = EntityQNet(entity_dim, action_num).eval()

    # three observations with 8, 5 and 2 live units; the empty slots are zero-filled
    units = [torch.randn(8, entity_dim), torch.randn(5, entity_dim), torch.randn(2, entity_dim)]
    entities, mask = collate_units(units, max_units)

    with torch.no_grad():
        q = model(entities, mask)
    print("q values:")
    for b in range(q.shape[0]):
        print(f"  sample {b} ({int(mask[b].sum())} units):", [round(v, 4) for v in q[b].tolist()])
    print("greedy actions:", q.argmax(-1).tolist())

    # one TD-style regression step on the padded batch
    torch.manual_seed(1)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    target = torch.randn(q.shape[0])
    actions = torch.tensor([1, 3, 0])
    q_train = model(entities, mask)
    loss = F.mse_loss(q_train.gather(1, actions[:, None]).squeeze(1), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("td loss: %.6f" % loss.item())


if __name__ == "__main__":
    main()
