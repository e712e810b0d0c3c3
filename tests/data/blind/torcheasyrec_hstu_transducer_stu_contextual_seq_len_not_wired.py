"""TorchEasyRec HSTUTransducer: the STU layers never learn that the preprocessor put contextual tokens first.

Citation: alibaba/TorchEasyRec#450, commit eed874e6 ("[bugfix] fix contextual_seq_len not passed
from preprocessor to STULayer"), tzrec/modules/gr/hstu_transducer.py.

The bug: ``HSTUTransducer.__init__`` built ``STUStack([STULayer(**stu) ...])`` straight from the
``stu`` config dict, which has no ``contextual_seq_len`` entry, so every STULayer kept its default
``contextual_seq_len=0``. The ``ContextualInterleavePreprocessor`` meanwhile prepends
``max_contextual_seq_len`` contextual tokens (user / request features) to every jagged sequence.
The HSTU attention mask (``_get_valid_attn_mask``) then treats those tokens as the first events
of a plain causal history: contextual token 0 sees only itself, the later contextual tokens
do not see each other both ways, and the block built for contextual tokens is never built.

The fix: build the preprocessor first and, when ``stu`` has no ``contextual_seq_len``, set
``stu["contextual_seq_len"] = self._input_preprocessor.contextual_seq_len()`` before building the
STULayers.

This program keeps TorchEasyRec's layout at toy sizes with random weights: a
ContextualInterleavePreprocessor (batched contextual linear, contextual tokens concatenated in
front of the jagged UIH + candidate sequence), STULayer (layer-normed uvqk projection, SiLU
pointwise attention ``silu(qk) / max_seq_len`` masked by ``_get_valid_attn_mask`` with
num_targets, u-gated layer-normed output), STUStack and the transducer's candidate split. The
fbgemm jagged<->padded ops are written in plain torch. The PYTORCH kernel path is used.
"""

import sys
import zlib
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------------------
# plain-torch stand-ins for torch.ops.fbgemm jagged ops
# ---------------------------------------------------------------------------
def asynchronous_complete_cumsum(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


def jagged_to_padded_dense(values, offsets, max_length, padding_value=0.0):
    B = offsets.numel() - 1
    out = values.new_full((B, max_length, values.shape[-1]), padding_value)
    for b in range(B):
        s, e = int(offsets[b]), int(offsets[b + 1])
        out[b, : e - s] = values[s:e]
    return out


def dense_to_jagged(dense, offsets):
    rows = []
    for b in range(offsets.numel() - 1):
        n = int(offsets[b + 1] - offsets[b])
        rows.append(dense[b, :n])
    return torch.cat(rows, 0)


def concat_2D_jagged(values_left, values_right, max_len_left, offsets_left, offsets_right):
    # offsets_left None: dense left part of max_len_left rows per sequence
    B = offsets_right.numel() - 1
    rows = []
    for b in range(B):
        if offsets_left is None:
            left = values_left[b * max_len_left : (b + 1) * max_len_left]
        else:
            left = values_left[int(offsets_left[b]) : int(offsets_left[b + 1])]
        right = values_right[int(offsets_right[b]) : int(offsets_right[b + 1])]
        rows.append(torch.cat([left, right], 0))
    return torch.cat(rows, 0)


# ---------------------------------------------------------------------------
# tzrec/ops/_pytorch/pt_hstu_attention.py
# ---------------------------------------------------------------------------
def _get_valid_attn_mask(
    device: torch.device,
    causal: bool,
    N: int,
    seq_lengths: torch.Tensor,
    num_targets: Optional[torch.Tensor] = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
) -> torch.Tensor:
    ids = torch.arange(0, N, device=device).view(1, N)
    max_ids = seq_lengths.view(-1, 1, 1)
    if contextual_seq_len > 0:
        ids = ids - contextual_seq_len + 1
        ids = torch.clamp(ids, min=0)
        max_ids = max_ids - contextual_seq_len + 1
    if num_targets is not None:
        max_ids = max_ids - num_targets.view(-1, 1, 1)
        ids = torch.clamp(
            ids,
            max=max_ids,
        )
        row_ids = ids.view(-1, N, 1).expand(-1, N, N)
        col_ids = ids.view(-1, 1, N).expand(-1, N, N)
    else:
        row_ids = ids.view(N, 1).expand(N, N)
        col_ids = row_ids.t()
        row_ids = row_ids.view(1, N, N)
        col_ids = col_ids.view(1, N, N)
    row_col_dist = row_ids - col_ids
    valid_attn_mask = torch.eye(N, device=device, dtype=torch.bool).view(1, N, N)
    if not causal:
        row_col_dist = torch.where(row_col_dist > 0, row_col_dist, -row_col_dist)
    valid_attn_mask = torch.logical_or(valid_attn_mask, row_col_dist > 0)
    if max_attn_len > 0:
        if min_full_attn_seq_len > 0:
            valid_attn_mask = torch.logical_and(
                valid_attn_mask,
                torch.logical_or(
                    row_col_dist <= max_attn_len,
                    row_ids >= max_ids - min_full_attn_seq_len,
                ),
            )
        else:
            valid_attn_mask = torch.logical_and(
                valid_attn_mask, row_col_dist <= max_attn_len
            )
    if contextual_seq_len > 0:
        valid_attn_mask = torch.logical_or(
            valid_attn_mask, torch.logical_and(row_ids == 0, col_ids < max_ids)
        )
    return valid_attn_mask


def pytorch_hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    dropout_pr: float = 0.0,
    training: bool = True,
    num_targets: Optional[torch.Tensor] = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    min_full_attn_seq_len: int = 0,
) -> torch.Tensor:
    L, H, D = q.shape
    V = v.shape[2]
    q = jagged_to_padded_dense(q.reshape(L, H * D), seq_offsets, max_seq_len)
    k = jagged_to_padded_dense(k.reshape(L, H * D), seq_offsets, max_seq_len)
    v = jagged_to_padded_dense(v.reshape(L, H * V), seq_offsets, max_seq_len)
    q = q.view(-1, max_seq_len, H, D).transpose(1, 2)
    k = k.view(-1, max_seq_len, H, D).transpose(1, 2)
    v = v.view(-1, max_seq_len, H, V).transpose(1, 2)
    qk_attn = torch.einsum("bhxa,bhya->bhxy", q, k) * alpha
    qk_attn = F.silu(qk_attn) / max_seq_len
    valid_attn_mask = _get_valid_attn_mask(
        device=q.device,
        causal=causal,
        N=max_seq_len,
        seq_lengths=seq_offsets[1:] - seq_offsets[:-1],
        num_targets=num_targets,
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
        min_full_attn_seq_len=min_full_attn_seq_len,
    )
    qk_attn = qk_attn * valid_attn_mask.unsqueeze(1)
    if dropout_pr > 0.0:
        qk_attn = F.dropout(qk_attn, p=dropout_pr, training=training)
    attn_dense = torch.einsum("bhxd,bhdv->bhxv", qk_attn, v)  # [B, H, N, V]
    return dense_to_jagged(
        attn_dense.transpose(1, 2).flatten(2, 3), seq_offsets
    ).view(L, H, V)


# ---------------------------------------------------------------------------
# tzrec/ops/hstu_compute.py + _pytorch/pt_hstu_linear.py (Kernel.PYTORCH)
# ---------------------------------------------------------------------------
def hstu_compute_uqvk(x, norm_weight, norm_bias, norm_eps, num_heads, attn_dim,
                      hidden_dim, uvqk_weight, uvqk_bias):
    normed_x = F.layer_norm(x, (x.shape[-1],), weight=norm_weight, bias=norm_bias, eps=norm_eps)
    uvqk = torch.addmm(uvqk_bias, normed_x, uvqk_weight)
    u, v, q, k = torch.split(
        uvqk,
        [hidden_dim * num_heads, hidden_dim * num_heads,
         attn_dim * num_heads, attn_dim * num_heads],
        dim=1,
    )
    u = F.silu(u)
    q = q.view(-1, num_heads, attn_dim)
    k = k.view(-1, num_heads, attn_dim)
    v = v.view(-1, num_heads, hidden_dim)
    return u, q, k, v


def hstu_preprocess_and_attention(x, norm_weight, norm_bias, norm_eps, num_heads, attn_dim,
                                  hidden_dim, uvqk_weight, uvqk_bias, max_seq_len, seq_offsets,
                                  attn_alpha, causal, num_targets, max_attn_len,
                                  contextual_seq_len):
    u, q, k, v = hstu_compute_uqvk(x, norm_weight, norm_bias, norm_eps, num_heads, attn_dim,
                                   hidden_dim, uvqk_weight, uvqk_bias)
    attn_output = pytorch_hstu_mha(
        max_seq_len=max_seq_len,
        alpha=attn_alpha,
        q=q,
        k=k,
        v=v,
        seq_offsets=seq_offsets,
        causal=causal,
        dropout_pr=0.0,
        training=False,
        num_targets=num_targets,
        max_attn_len=max_attn_len,
        contextual_seq_len=contextual_seq_len,
    ).view(-1, hidden_dim * num_heads)
    return u, attn_output, k, v


def pytorch_hstu_compute_output(attn, u, x, norm_weight, norm_bias, output_weight, eps,
                                dropout_ratio, training, concat_ux=False):
    y = u * F.layer_norm(attn, (attn.shape[-1],), weight=norm_weight, bias=norm_bias, eps=eps)
    if concat_ux:
        y = torch.cat([u, attn, y], dim=1)
    y = F.dropout(y, p=dropout_ratio, training=training)
    return torch.addmm(x, y, output_weight)


# ---------------------------------------------------------------------------
# tzrec/modules/gr/stu.py
# ---------------------------------------------------------------------------
class STULayer(torch.nn.Module):
    def __init__(
        self,
        embedding_dim: int,
        num_heads: int,
        hidden_dim: int,
        attention_dim: int,
        output_dropout_ratio: float = 0.3,
        causal: bool = True,
        target_aware: bool = True,
        max_attn_len: Optional[int] = None,
        attn_alpha: Optional[float] = None,
        contextual_seq_len: int = 0,
    ) -> None:
        super().__init__()
        self._num_heads = num_heads
        self._embedding_dim = embedding_dim
        self._hidden_dim = hidden_dim
        self._attention_dim = attention_dim
        self._output_dropout_ratio = output_dropout_ratio
        self._target_aware = target_aware
        self._causal = causal
        self._max_attn_len = max_attn_len or 0
        self._attn_alpha = attn_alpha or 1.0 / (self._attention_dim**0.5)
        self._contextual_seq_len = contextual_seq_len

        self._uvqk_weight = torch.nn.Parameter(
            torch.empty((embedding_dim, (hidden_dim * 2 + attention_dim * 2) * num_heads))
        )
        torch.nn.init.xavier_uniform_(self._uvqk_weight)
        self._uvqk_beta = torch.nn.Parameter(
            torch.zeros((hidden_dim * 2 + attention_dim * 2) * num_heads)
        )
        self._input_norm_weight = torch.nn.Parameter(torch.ones((embedding_dim,)))
        self._input_norm_bias = torch.nn.Parameter(torch.zeros((embedding_dim,)))
        self._output_weight = torch.nn.Parameter(
            torch.empty((hidden_dim * num_heads * 3, embedding_dim))
        )
        torch.nn.init.xavier_uniform_(self._output_weight)
        self._output_norm_weight = torch.nn.Parameter(torch.ones((hidden_dim * num_heads,)))
        self._output_norm_bias = torch.nn.Parameter(torch.zeros((hidden_dim * num_heads,)))

    def forward(self, x, x_offsets, max_seq_len, num_targets):
        u, attn_output, k, v = hstu_preprocess_and_attention(
            x=x,
            norm_weight=self._input_norm_weight,
            norm_bias=self._input_norm_bias,
            norm_eps=1e-6,
            num_heads=self._num_heads,
            attn_dim=self._attention_dim,
            hidden_dim=self._hidden_dim,
            uvqk_weight=self._uvqk_weight,
            uvqk_bias=self._uvqk_beta,
            max_seq_len=max_seq_len,
            seq_offsets=x_offsets,
            attn_alpha=self._attn_alpha,
            causal=self._causal,
            num_targets=num_targets if self._target_aware else None,
            max_attn_len=self._max_attn_len,
            contextual_seq_len=self._contextual_seq_len,
        )
        return pytorch_hstu_compute_output(
            attn=attn_output,
            u=u,
            x=x,
            norm_weight=self._output_norm_weight,
            norm_bias=self._output_norm_bias,
            output_weight=self._output_weight,
            eps=1e-6,
            dropout_ratio=self._output_dropout_ratio,
            training=self.training,
            concat_ux=True,
        )


class STUStack(torch.nn.Module):
    def __init__(self, stu_list: List[STULayer]) -> None:
        super().__init__()
        self._stu_layers = torch.nn.ModuleList(stu_list)

    def forward(self, x, x_offsets, max_seq_len, num_targets):
        for layer in self._stu_layers:
            x = layer(x=x, x_offsets=x_offsets, max_seq_len=max_seq_len, num_targets=num_targets)
        return x


# ---------------------------------------------------------------------------
# tzrec/modules/gr/preprocessors.py (ContextualInterleavePreprocessor, no interleaving)
# ---------------------------------------------------------------------------
class ContextualInterleavePreprocessor(torch.nn.Module):
    def __init__(self, uih_embedding_dim, target_embedding_dim, output_embedding_dim,
                 contextual_feature_dim=0, max_contextual_seq_len=0,
                 contextual_group_name="contextual"):
        super().__init__()
        self._output_embedding_dim = output_embedding_dim
        self._contextual_feature_dim = contextual_feature_dim
        self._max_contextual_seq_len = max_contextual_seq_len
        self._contextual_group_name = contextual_group_name
        if max_contextual_seq_len > 0:
            std = 1.0 * (2.0 / float(contextual_feature_dim + output_embedding_dim)) ** 0.5
            self._batched_contextual_linear_weights = torch.nn.Parameter(
                torch.empty(
                    (max_contextual_seq_len, contextual_feature_dim, output_embedding_dim)
                ).normal_(0.0, std)
            )
            self._batched_contextual_linear_bias = torch.nn.Parameter(
                torch.empty((max_contextual_seq_len, 1, output_embedding_dim)).fill_(0.0)
            )
        self._content_embedding_mlp = torch.nn.Linear(uih_embedding_dim, output_embedding_dim)
        self._target_embedding_mlp = torch.nn.Linear(target_embedding_dim, output_embedding_dim)

    def contextual_seq_len(self) -> int:
        return self._max_contextual_seq_len

    def forward(self, grouped_features: Dict[str, torch.Tensor]):
        uih_lengths = grouped_features["uih.lengths"]
        num_targets = grouped_features["candidate.lengths"]
        contextual_input_embeddings = grouped_features[self._contextual_group_name]
        contextual_embeddings = torch.baddbmm(
            self._batched_contextual_linear_bias,
            contextual_input_embeddings.view(
                -1, self._max_contextual_seq_len, self._contextual_feature_dim
            ).transpose(0, 1),
            self._batched_contextual_linear_weights,
        ).transpose(0, 1)  # [B, C, D]

        uih_offsets = asynchronous_complete_cumsum(uih_lengths)
        cand_offsets = asynchronous_complete_cumsum(num_targets)
        uih = self._content_embedding_mlp(grouped_features["uih"])
        cand = self._target_embedding_mlp(grouped_features["candidate"])
        seq_lengths = uih_lengths + num_targets
        max_uih_len = int(uih_lengths.max())
        max_targets = int(num_targets.max())
        output_seq_embeddings = concat_2D_jagged(
            uih, cand, None, uih_offsets, cand_offsets
        )
        output_max_seq_len = max_uih_len + max_targets
        output_seq_lengths = seq_lengths
        output_total_uih_len = int(uih_lengths.sum())
        output_total_targets = int(num_targets.sum())

        # concat contextual embeddings
        output_seq_offsets = asynchronous_complete_cumsum(output_seq_lengths)
        if self._max_contextual_seq_len > 0:
            output_seq_embeddings = concat_2D_jagged(
                values_left=contextual_embeddings.reshape(-1, self._output_embedding_dim),
                values_right=output_seq_embeddings,
                max_len_left=self._max_contextual_seq_len,
                offsets_left=None,
                offsets_right=output_seq_offsets,
            )
            output_max_seq_len = output_max_seq_len + self._max_contextual_seq_len
            output_total_uih_len = (
                output_total_uih_len
                + self._max_contextual_seq_len * output_seq_lengths.size(0)
            )
            output_seq_lengths = output_seq_lengths + self._max_contextual_seq_len
            output_seq_offsets = asynchronous_complete_cumsum(output_seq_lengths)
        return (
            output_max_seq_len,
            output_total_uih_len,
            output_total_targets,
            output_seq_lengths,
            output_seq_offsets,
            output_seq_embeddings,
            num_targets,
        )


# ---------------------------------------------------------------------------
# tzrec/modules/gr/hstu_transducer.py
# ---------------------------------------------------------------------------
class HSTUTransducer(torch.nn.Module):
    def __init__(
        self,
        uih_embedding_dim: int,
        target_embedding_dim: int,
        stu: Dict[str, Any],
        attn_num_layers: int,
        input_preprocessor: Dict[str, Any],
        contextual_feature_dim: int = 0,
        max_contextual_seq_len: int = 0,
        contextual_group_name: str = "contextual",
    ) -> None:
        super().__init__()
        if not FIXED:
            self._stu_module = STUStack(
                stu_list=[STULayer(**stu) for _ in range(attn_num_layers)],
            )
        self._input_preprocessor = ContextualInterleavePreprocessor(
            uih_embedding_dim=uih_embedding_dim,
            target_embedding_dim=target_embedding_dim,
            contextual_feature_dim=contextual_feature_dim,
            max_contextual_seq_len=max_contextual_seq_len,
            contextual_group_name=contextual_group_name,
            output_embedding_dim=stu["embedding_dim"],
            **input_preprocessor,
        )
        if FIXED:
            stu = dict(stu)
            if "contextual_seq_len" not in stu:
                stu["contextual_seq_len"] = self._input_preprocessor.contextual_seq_len()
            self._stu_module = STUStack(
                stu_list=[STULayer(**stu) for _ in range(attn_num_layers)],
            )

    def forward(self, grouped_features: Dict[str, torch.Tensor]) -> torch.Tensor:
        (
            max_seq_len,
            total_uih_len,
            total_targets,
            seq_lengths,
            seq_offsets,
            seq_embeddings,
            num_targets,
        ) = self._input_preprocessor(grouped_features)
        seq_embeddings = self._stu_module(
            max_seq_len=max_seq_len,
            x=seq_embeddings,
            x_offsets=seq_offsets,
            num_targets=num_targets,
        )
        # split_2D_jagged: keep the candidate part of every sequence
        uih_offsets = asynchronous_complete_cumsum(seq_lengths - num_targets)
        candidate_embeddings = []
        for b in range(seq_lengths.numel()):
            end = int(seq_offsets[b + 1])
            candidate_embeddings.append(seq_embeddings[end - int(num_targets[b]) : end])
        candidate_embeddings = torch.cat(candidate_embeddings, 0)
        return F.normalize(candidate_embeddings, dim=-1)


def load_toy_checkpoint(model: torch.nn.Module) -> None:
    """Stand-in for restoring a trained checkpoint: every weight matrix drawn from its own name."""
    state = {}
    for name, p in model.state_dict().items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        if p.dim() >= 2:
            state[name] = torch.randn(p.shape, generator=g) * (1.0 / p.shape[-2] ** 0.5)
        elif "norm_weight" in name:
            state[name] = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        else:
            state[name] = 0.1 * torch.randn(p.shape, generator=g)
    model.load_state_dict(state)


def main() -> None:
    torch.manual_seed(0)
    D = 16
    model = HSTUTransducer(
        uih_embedding_dim=12,
        target_embedding_dim=12,
        stu={
            "embedding_dim": D,
            "num_heads": 2,
            "hidden_dim": 8,
            "attention_dim": 8,
            "output_dropout_ratio": 0.0,
            "causal": True,
            "target_aware": True,
        },
        attn_num_layers=2,
        input_preprocessor={},
        contextual_feature_dim=6,
        max_contextual_seq_len=3,
    )
    load_toy_checkpoint(model)
    model.eval()

    uih_lengths = torch.tensor([5, 3])
    num_targets = torch.tensor([2, 1])
    g = torch.Generator().manual_seed(1)
    grouped_features = {
        "uih": torch.randn(int(uih_lengths.sum()), 12, generator=g),
        "uih.lengths": uih_lengths,
        "candidate": torch.randn(int(num_targets.sum()), 12, generator=g),
        "candidate.lengths": num_targets,
        "contextual": torch.randn(2, 3 * 6, generator=g),
    }
    with torch.no_grad():
        cand = model(grouped_features)
        scores = cand @ cand.new_ones(D) / D**0.5
    print("candidate embeddings:", tuple(cand.shape))
    print("candidate scores:", [round(s, 5) for s in scores.tolist()])


if __name__ == "__main__":
    main()
