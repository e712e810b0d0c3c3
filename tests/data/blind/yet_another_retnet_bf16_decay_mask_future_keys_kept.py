# fkodom/yet-another-retnet#25 (commit bf2acc5, "Fix bug with _build_decay_mask for 'bfloat' dtypes"; reported in
# issue #24). Parallel retention multiplies q.k^T by a per-head decay mask gamma_h ** |n - m|; to zero the future,
# _build_decay_mask set the upper-triangular distances to +inf, relying on gamma ** inf == 0 for gamma < 1. In
# bfloat16 the slowest head's gamma (1 - 1/512) rounds to exactly 1.0, and 1.0 ** inf == 1, so that head's decay
# mask is all ones above the diagonal and every position retains the future tokens' values. Fix: raise gamma to the
# finite distances and then masked_fill the upper triangle (diagonal=1) with 0.
# (RetNet with MultiScaleRetention.forward_parallel, built in bfloat16; einops calls written out with torch.)
import sys
from functools import lru_cache
from math import log
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv


def _get_activation_fn(activation: str) -> Callable[[Tensor], Tensor]:
    """Return an activation function given a string"""
    if activation == "swish":
        return F.silu
    elif activation == "gelu":
        return F.gelu
    elif activation == "relu":
        return F.relu
    else:
        raise RuntimeError(f"Unsupported activation string '{activation}'.")


@lru_cache(maxsize=1)
def _build_decay_gammas(
    num_heads: int,
    device: Optional[Union[torch.device, str]] = None,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """See: https://arxiv.org/pdf/2307.08621v3.pdf, Section 3.1 (Setup)"""
    xmin, xmax = log(1 / 32), log(1 / 512)
    x = torch.linspace(xmin, xmax, steps=num_heads, device=device, dtype=dtype)
    return 1 - x.exp_()


@lru_cache(maxsize=1)
def _build_decay_mask(
    num_heads: int,
    query_length: int,
    key_length: int,
    device: Optional[Union[torch.device, str]] = None,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """See: https://arxiv.org/pdf/2307.08621v3.pdf, Equation 5"""
    decay_gammas = _build_decay_gammas(num_heads=num_heads, device=device, dtype=dtype)

    query_pos = torch.arange(query_length, device=device, dtype=dtype).unsqueeze_(-1)
    key_pos = torch.arange(key_length, device=device, dtype=dtype).unsqueeze_(0)
    distance = torch.abs(query_pos - key_pos)

    if not FIXED:
        # Set the upper-triangular distances to infinity, so that only *past* keys
        # can affect the current query.  (Setting distance to infinity ensures that
        # the decay matrix is 0 for those positions, since x^(inf) = 0 when -1 < x < 1.
        distance_mask = torch.ones_like(distance, dtype=torch.bool).triu_(diagonal=1)
        distance = distance.masked_fill_(distance_mask, float("inf"))

        distance = distance[None, :, :]  # "n s -> () n s"
        decay_gammas = decay_gammas[:, None, None]  # "h -> h () ()"
        return decay_gammas**distance

    distance = distance[None, :, :]  # "n s -> () n s"
    decay_gammas = decay_gammas[:, None, None]  # "h -> h () ()"
    # NOTE: Keep only the lower-triangular elements (including the diagonal), so that
    # *future* keys cannot affect the current query. The .tril() method is not yet
    # implemented for bfloat16 dtypes, so we use .masked_fill_() instead.
    decay_mask = decay_gammas**distance
    future_mask = torch.ones_like(decay_mask, dtype=torch.bool).triu_(diagonal=1)
    return decay_mask.masked_fill_(future_mask, 0)


def _build_position_thetas(
    head_dim: int,
    scale: float = 10000,
    device: Optional[Union[torch.device, str]] = None,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    x = torch.linspace(0, 1, steps=head_dim // 2, device=device, dtype=dtype)
    thetas = 1 / (scale**x)
    return thetas.repeat_interleave(2)  # "d -> (d n)", n=2


def _multiply_by_i(x: Tensor) -> Tensor:
    """Multiply a complex-valued tensor by the imaginary unit 'i'."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(start_dim=-2)


def _theta_shift(x: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
    return (x * cos) + (_multiply_by_i(x) * sin)


def retention_parallel(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scale: Optional[float] = None,
    need_weights: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    decay_mask = _build_decay_mask(
        num_heads=query.shape[1],
        query_length=query.shape[2],
        key_length=key.shape[2],
        device=query.device,
        dtype=query.dtype,
    )

    # einstein notation:
    # - b: batch_size
    # - h: num_heads
    # - n / s: seq_length
    # - d: hidden_dim
    if scale is None:
        scale = key.size(-1) ** 0.5
    key = key / scale

    similarity = torch.einsum("bhnd,bhsd->bhns", query, key)
    similarity = similarity * decay_mask[None]  # "h n s -> () h n s"
    retention = torch.einsum("bhns,bhsd->bhnd", similarity, value)

    if need_weights:
        return retention, similarity
    else:
        return retention, None


class MultiScaleRetention(nn.Module):
    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        relative_position: bool = True,
        bias: bool = True,
        batch_first: bool = True,
        activation: Union[str, Callable[[Tensor], Tensor]] = "swish",
        group_norm_eps: float = 1e-6,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        if not batch_first:
            raise NotImplementedError("batch_first=False is not yet supported")
        if isinstance(activation, str):
            activation = _get_activation_fn(activation)

        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.relative_position = relative_position
        self.bias = bias
        self.activation = activation

        head_dim = embed_dim // num_heads
        if not head_dim % 8 == 0:
            raise ValueError(f"head_dim ({head_dim}) must be divisible by 8")

        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.group_norm = nn.GroupNorm(
            num_groups=num_heads,
            num_channels=embed_dim,
            affine=False,
            eps=group_norm_eps,
            device=device,
            dtype=dtype,
        )
        self.g_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)

        thetas: Optional[Tensor] = None
        if relative_position:
            thetas = _build_position_thetas(head_dim=head_dim, device=device, dtype=dtype)
        self.thetas: Optional[Tensor]
        self.register_buffer("thetas", thetas)

        self._reset_parameters()

    def _reset_parameters(self):
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj, self.g_proj):
            nn.init.xavier_normal_(proj.weight)
            if proj.bias is not None:
                nn.init.constant_(proj.bias, 0)

    def forward_parallel(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        need_weights: bool = False,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        # Input shape: (b, n, d)
        q: Tensor = self.q_proj(query)
        k: Tensor = self.k_proj(key)
        v: Tensor = self.v_proj(value)

        # "b n (h d) -> b h n d"
        b, n, _ = q.shape
        q = q.view(b, n, self.num_heads, -1).transpose(1, 2)
        k = k.view(b, k.size(1), self.num_heads, -1).transpose(1, 2)
        v = v.view(b, v.size(1), self.num_heads, -1).transpose(1, 2)

        if self.relative_position:
            assert self.thetas is not None
            indices = torch.arange(q.size(2), device=q.device, dtype=q.dtype)
            indices = indices[None, None, :, None]  # "n -> () () n ()"
            thetas = self.thetas[None, None, None, :]  # "d -> () () () d"
            angles = indices * thetas
            sin = torch.sin(angles)
            cos = torch.cos(angles)

            q = _theta_shift(q, sin, cos)
            k = _theta_shift(k, sin, cos)

        # Apply retention then group norm.
        retention, weights = retention_parallel(q, k, v, need_weights=need_weights)
        batch_size = retention.size(0)
        retention = retention.permute(0, 2, 1, 3).reshape(-1, self.embed_dim)  # "b h n d -> (b n) (h d)"
        retention = F.dropout(retention, p=self.dropout, training=self.training)
        retention = self.group_norm(retention)
        retention = retention.view(batch_size, -1, self.embed_dim)  # "(b n) e -> b n e"

        gate = self.activation(self.g_proj(query))
        retention = self.out_proj(retention * gate)

        return retention, weights


class RetNetDecoderLayer(nn.Module):
    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Union[str, Callable[[Tensor], Tensor]] = "swish",
        norm_first: bool = True,
        layer_norm_eps: float = 1e-6,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        if isinstance(activation, str):
            activation = _get_activation_fn(activation)

        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.activation = activation
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, device=device, dtype=dtype)
        self.retention = MultiScaleRetention(
            embed_dim=d_model,
            num_heads=nhead,
            dropout=dropout,
            activation=activation,
            device=device,
            dtype=dtype,
        )
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, device=device, dtype=dtype)
        self.linear1 = nn.Linear(d_model, dim_feedforward, device=device, dtype=dtype)
        self.linear2 = nn.Linear(dim_feedforward, d_model, device=device, dtype=dtype)

        nn.init.xavier_normal_(self.linear1.weight)
        nn.init.constant_(self.linear1.bias, 0)
        nn.init.xavier_normal_(self.linear2.weight)
        nn.init.constant_(self.linear2.bias, 0)

    def _feedforward_block(self, x: Tensor) -> Tensor:
        x = self.activation(self.linear1(x))
        x = self.dropout(x)
        x = self.linear2(x)
        x = self.dropout(x)
        return x

    def forward_parallel(self, x: Tensor) -> Tensor:
        def _retention_block(x: Tensor) -> Tensor:
            x, _ = self.retention.forward_parallel(x, x, x)
            return self.dropout(x)

        if self.norm_first:
            x = x + _retention_block(self.norm1(x))
            x = x + self._feedforward_block(self.norm2(x))
        else:
            x = x + self.norm1(_retention_block(x))
            x = x + self.norm2(self._feedforward_block(x))

        return x


class RetNet(nn.Module):
    def __init__(
        self,
        num_tokens: int,
        d_model: int = 512,
        nhead: int = 8,
        num_layers: int = 6,
        dropout: float = 0.1,
        activation: Union[str, Callable[[Tensor], Tensor]] = "swish",
        dim_feedforward: int = 2048,
        norm_first: bool = True,
        layer_norm_eps: float = 1e-6,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.num_layers = num_layers
        self.embedding = nn.Embedding(num_tokens, d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            [
                RetNetDecoderLayer(
                    d_model,
                    nhead,
                    dropout=dropout,
                    activation=activation,
                    dim_feedforward=dim_feedforward,
                    norm_first=norm_first,
                    layer_norm_eps=layer_norm_eps,
                    device=device,
                    dtype=dtype,
                )
                for _ in range(num_layers)
            ]
        )
        self.out = nn.Linear(d_model, num_tokens, device=device, dtype=dtype)
        nn.init.xavier_normal_(self.out.weight)
        nn.init.constant_(self.out.bias, 0)

    def forward_parallel(self, x: Tensor) -> Tensor:
        x = self.embedding(x)
        for layer in self.layers:
            x = layer.forward_parallel(x)
        x = self.out(x)
        return x

    def forward(self, inputs: Tensor, labels: Tensor) -> Tensor:
        pred = self.forward_parallel(inputs)
        criterion = nn.CrossEntropyLoss()
        return criterion(pred.reshape(-1, pred.size(-1)), labels.flatten())


def main():
    torch.manual_seed(0)
    num_tokens = 97
    # the model built directly in bfloat16 (the RetNet constructor's dtype argument)
    model = RetNet(
        num_tokens=num_tokens,
        d_model=64,
        nhead=8,
        num_layers=2,
        dropout=0.0,
        dim_feedforward=128,
        dtype=torch.bfloat16,
    )
    model.eval()

    tokens = torch.randint(0, num_tokens, (2, 17))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    with torch.no_grad():
        loss = model(inputs, labels)
        logits = model.forward_parallel(inputs)
    print("next-token loss:", round(loss.float().item(), 4))
    print("logits[0, 0, :4]:", [round(v, 4) for v in logits[0, 0, :4].float().tolist()])


if __name__ == "__main__":
    main()
