# Citation: ServiceNow/Fast-LLM @11a5a219cb43e131f1a9e5c3fb2c73bb6ad89c18:
#   fast_llm/layers/attention/preprocessing.py (BackupAttentionPreprocessor._create_tensors / preprocess,
#   FlashAttnVarlenPreprocessor.preprocess), fast_llm/layers/attention/attention.py (Attention._attn_fused,
#   Attention.forward's flash / backup branch), fast_llm/layers/attention/rotary/rotary.py (DefaultRotary,
#   apply_rotary_embeddings).
# Fast-LLM trains a decoder-only LM on packed rows: each row of `sequence_length` tokens holds several documents whose
# lengths travel in kwargs["sequence_lengths"] (one tensor per row). With flash attention the
# FlashAttnVarlenPreprocessor turns those lengths into cu_seqlens_q / cu_seqlens_k (a leading 0 then the cumsum over
# every row's documents) and the layer flattens (batch, seq) and calls flash_attn_varlen_func with causal=True. The
# "backup" implementation (no flash, e.g. on CPU) builds a bool tril cached at the longest sequence length, and ANDs it
# with a document mask (seq_ids[:, None, :] == seq_ids[:, :, None]), shaped (b, 1, sq, 1, sk) to match the
# (b, head_groups, sq, heads_per_group, sk) scores; torch.where(mask, scores, finfo.min) then softmax in float32.
# Rotary uses the row position (not restarted per document), which leaves every in-document score unchanged.
# flash_attn is not importable on CPU, so _flash_attn_varlen_func below is a plain-torch stand-in with the kernel's
# contract (one causal softmax per [cu_seqlens[i], cu_seqlens[i+1]) span, GQA by head groups).
# Self-check: both implementations on two packed rows (documents 5+3+4 and 7+5) give, at every token, the output of
# the same layer run on its document alone (one row, positions from 0, no sequence_lengths), and a double loop over
# queries / keys of each document reproduces the backup scores' softmax.
import math
import typing

import torch
import torch.nn.functional as F

torch.manual_seed(0)


# ---- fast_llm/layers/attention/config.py: AttentionKwargs (names only) ----
class AttentionKwargs:
    sequence_first = "sequence_first"
    sequence_length = "sequence_length"
    sequence_q_dim = "sequence_q_dim"
    sequence_k_dim = "sequence_k_dim"
    sequence_lengths = "sequence_lengths"
    attention_mask = "attention_mask"
    attention_mask_value = "attention_mask_value"
    cu_seqlens_q = "cu_seqlens_q"
    cu_seqlens_k = "cu_seqlens_k"
    max_seqlen_q = "max_seqlen_q"
    max_seqlen_k = "max_seqlen_k"
    rotary_freq_q = "rotary_freq_q"
    rotary_freq_k = "rotary_freq_k"
    past_key_values = "past_key_values"
    presents = "presents"


class TensorDim:
    def __init__(self, name, size):
        self.name = name
        self.size = size


class AttentionConfig:
    num_attention_heads = 4
    head_groups = 2
    kv_channels = 8
    window_size = None
    max_window_layers = None
    attention_dropout = 0.0
    attention_softmax_scale_power = 0.5
    rotary_theta = 10000.0


TRAINING_DTYPE = torch.float32


# ---- fast_llm/layers/attention/rotary/rotary.py ----
def apply_rotary_embeddings(tensor: torch.Tensor, rope_frequencies: torch.Tensor) -> torch.Tensor:
    complex_tensor = torch.view_as_complex(tensor.to(torch.float32).view(*tensor.shape[:-1], -1, 2))
    return torch.view_as_real(complex_tensor * rope_frequencies).view_as(tensor).type_as(tensor)


class DefaultRotary:
    _tensor_cache_max_sequence_length: int = -1

    def __init__(self, kv_channels: int, theta: float):
        self._kv_channels = kv_channels
        self._theta = theta

    def preprocess(self, batch: torch.Tensor, kwargs: dict[str, typing.Any]) -> None:
        self._create_tensors(kwargs[AttentionKwargs.sequence_length], batch.device)
        sequence_k = kwargs[AttentionKwargs.sequence_k_dim].size
        kwargs[AttentionKwargs.rotary_freq_q] = self._rotary_embedding_frequencies[
            :, sequence_k - kwargs[AttentionKwargs.sequence_q_dim].size : sequence_k
        ]
        kwargs[AttentionKwargs.rotary_freq_k] = self._rotary_embedding_frequencies[:, :sequence_k]

    def forward(self, query, key, kwargs):
        query = apply_rotary_embeddings(query, kwargs[AttentionKwargs.rotary_freq_q])
        key = apply_rotary_embeddings(key, kwargs[AttentionKwargs.rotary_freq_k])
        return query, key

    __call__ = forward

    def _create_tensors(self, sequence_length: int, device: torch.device) -> None:
        if sequence_length <= self._tensor_cache_max_sequence_length:
            return
        self._tensor_cache_max_sequence_length = sequence_length
        positions = torch.arange(sequence_length, device=device, dtype=torch.float64)
        scales = self._theta ** -torch.arange(0, 1, 2 / self._kv_channels, device=device, dtype=torch.float64)
        angles = torch.outer(positions, scales)
        # complex_format: (1, seq, 1, kv_channels / 2)
        self._rotary_embedding_frequencies = torch.polar(torch.ones_like(angles), angles)[None, :, None, :].to(
            torch.complex64
        )


# ---- fast_llm/layers/attention/preprocessing.py ----
class BackupAttentionPreprocessor:
    _tensor_cache_max_sequence_length: int = -1

    def __init__(self, config: AttentionConfig):
        self._config = config

    def _create_tensors(self, sequence_length: int, device: torch.device) -> None:
        if sequence_length <= self._tensor_cache_max_sequence_length:
            return
        self._tensor_cache_max_sequence_length = sequence_length

        self._mask = torch.ones(
            (sequence_length, sequence_length),
            dtype=torch.bool,
            device=device,
        ).tril_()

        if self._config.window_size is not None:
            self._mask.triu_(-self._config.window_size + 1)
        self._mask_value = torch.full(
            [],
            torch.finfo(TRAINING_DTYPE).min,
            dtype=TRAINING_DTYPE,
            device=device,
        )

    def preprocess(self, batch: torch.Tensor, kwargs: dict[str, typing.Any]) -> None:
        self._create_tensors(kwargs[AttentionKwargs.sequence_length], batch.device)
        sequence_k = kwargs[AttentionKwargs.sequence_k_dim].size
        sequence_q = kwargs[AttentionKwargs.sequence_q_dim].size
        kwargs[AttentionKwargs.attention_mask] = self._mask[
            None, None, sequence_k - sequence_q : sequence_k, None, :sequence_k
        ]
        if (sequence_lengths := kwargs.get(AttentionKwargs.sequence_lengths, None)) is not None:
            seq_ids = torch.stack(
                [
                    torch.cat([torch.full((x,), i) for i, x in enumerate(sample_lens)])
                    for sample_lens in sequence_lengths
                ]
            )
            document_mask = (seq_ids[:, None, :] == seq_ids[:, :, None]).to(batch.device)
            kwargs[AttentionKwargs.attention_mask] = (
                kwargs[AttentionKwargs.attention_mask]
                & document_mask[:, None, sequence_k - sequence_q : sequence_k, None, :sequence_k]
            )
        kwargs[AttentionKwargs.attention_mask_value] = self._mask_value


class FlashAttnVarlenPreprocessor:
    def __init__(self, config: AttentionConfig):
        self._config = config

    def preprocess(self, batch: torch.Tensor, kwargs: dict[str, typing.Any]) -> None:
        # No sequence-data parallelism here: sequence_q == sequence_length, so cu_seqlens_q = cu_seqlens_k.
        if AttentionKwargs.sequence_lengths not in kwargs:
            return
        sequence_lengths = kwargs[AttentionKwargs.sequence_lengths]
        assert kwargs[AttentionKwargs.sequence_q_dim].size == kwargs[AttentionKwargs.sequence_length]
        seqlens_q = torch.cat(sequence_lengths)
        seqlens_k = torch.cat(sequence_lengths)
        kwargs[AttentionKwargs.cu_seqlens_q] = torch.cat(
            (
                torch.zeros(1, dtype=torch.int32, device=batch.device),
                torch.cumsum(seqlens_q, dim=0, dtype=torch.int32).to(batch.device),
            )
        )
        kwargs[AttentionKwargs.cu_seqlens_k] = torch.cat(
            (
                torch.zeros(1, dtype=torch.int32, device=batch.device),
                torch.cumsum(seqlens_k, dim=0, dtype=torch.int32).to(batch.device),
            )
        )
        kwargs[AttentionKwargs.max_seqlen_q] = seqlens_q.max()
        kwargs[AttentionKwargs.max_seqlen_k] = seqlens_k.max()


# ---- plain-torch stand-in for flash_attn.flash_attn_interface.flash_attn_varlen_func ----
def _flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, window_size=(-1, -1),
    causal=False, softmax_scale=None,
):
    # q: (total_q, heads, d); k, v: (total_k, head_groups, d)
    assert window_size == (-1, -1) and dropout_p == 0.0
    out = torch.empty_like(q)
    rep = q.size(1) // k.size(1)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[qs:qe].transpose(0, 1)
        ki = k[ks:ke].repeat_interleave(rep, dim=1).transpose(0, 1)
        vi = v[ks:ke].repeat_interleave(rep, dim=1).transpose(0, 1)
        out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, scale=softmax_scale).transpose(0, 1)
    return out


# ---- fast_llm/layers/attention/attention.py ----
class Attention(torch.nn.Module):
    def __init__(self, config: AttentionConfig, hidden_size: int, block_index: int, use_flash_attention: bool):
        super().__init__()
        self._config = config
        self._block_index = block_index
        self._use_flash_attention = use_flash_attention
        self._local_head_groups = config.head_groups
        self._local_heads_per_group = config.num_attention_heads // config.head_groups
        self._local_heads = self._local_head_groups * self._local_heads_per_group
        self._softmax_scale = config.kv_channels ** (-config.attention_softmax_scale_power)
        self.query = torch.nn.Linear(hidden_size, self._local_heads * config.kv_channels)
        self.key_value = torch.nn.Linear(hidden_size, 2 * self._local_head_groups * config.kv_channels)
        self.dense = torch.nn.Linear(self._local_heads * config.kv_channels, hidden_size)
        self._rotary = DefaultRotary(config.kv_channels, config.rotary_theta)

    def _attn_fused(self, query, key, value, mask, mask_value):
        # Backup attention (inefficient)
        b, sq, hidden = query.shape
        sk = key.size(1)

        if self._local_head_groups == 1:
            query = query.view(b, sq * self._local_heads, self._config.kv_channels)
            key = key.transpose(-1, -2)
        else:
            query = (
                query.unflatten(-1, (self._local_head_groups, self._local_heads_per_group, self._config.kv_channels))
                .transpose(1, 2)
                .reshape(b * self._local_head_groups, sq * self._local_heads_per_group, self._config.kv_channels)
            )
            key = key.unflatten(-1, (self._local_head_groups, self._config.kv_channels)).movedim(1, 3).flatten(0, 1)
            value = (
                value.unflatten(-1, (self._local_head_groups, self._config.kv_channels)).transpose(1, 2).flatten(0, 1)
            )

        attn_weights = torch.empty(
            (b * self._local_head_groups, sq * self._local_heads_per_group, sk), device=query.device, dtype=query.dtype
        )
        attn_weights = torch.baddbmm(
            attn_weights,
            query,
            key,
            beta=0,
            alpha=self._softmax_scale / self._block_index,
        ).view(b, self._local_head_groups, sq, self._local_heads_per_group, sk)

        attn_weights = attn_weights.to(torch.float32) * self._block_index
        attn_weights = torch.where(mask, attn_weights, mask_value)
        attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1).to(query.dtype)
        self.last_probs = attn_weights

        attn_weights = torch.dropout(attn_weights, self._config.attention_dropout, self.training)
        attn_output = torch.bmm(
            attn_weights.view(b * self._local_head_groups, sq * self._local_heads_per_group, sk), value
        )

        if self._local_head_groups == 1:
            return attn_output.view(b, sq, -1)
        else:
            return (
                attn_output.view(b, self._local_head_groups, sq, self._local_heads_per_group, self._config.kv_channels)
                .transpose(1, 2)
                .flatten(2)
            )

    def forward(self, input_: torch.Tensor, kwargs: dict[str, typing.Any]) -> torch.Tensor:
        assert not kwargs[AttentionKwargs.sequence_first]
        query = self.query(input_)
        key_value = self.key_value(input_)

        key, value = key_value.split(self._local_head_groups * self._config.kv_channels, dim=-1)

        query = query.view(*query.shape[:2], self._local_heads, self._config.kv_channels)
        key = key.view(*key.shape[:2], self._local_head_groups, self._config.kv_channels)
        value = value.view(*value.shape[:2], self._local_head_groups, self._config.kv_channels)

        query, key = self._rotary(query, key, kwargs)

        window_size = self._config.window_size

        if self._use_flash_attention:
            if (cu_seqlens_q := kwargs.get(AttentionKwargs.cu_seqlens_q, None)) is not None:
                out_dims = query.size()
                query = query.view(-1, query.size(-2), query.size(-1))
                key = key.view(-1, key.size(-2), key.size(-1))
                value = value.view(-1, value.size(-2), value.size(-1))
                input_ = _flash_attn_varlen_func(
                    query,
                    key,
                    value,
                    cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=kwargs.get(AttentionKwargs.cu_seqlens_k),
                    max_seqlen_q=kwargs.get(AttentionKwargs.max_seqlen_q),
                    max_seqlen_k=kwargs.get(AttentionKwargs.max_seqlen_k),
                    dropout_p=self._config.attention_dropout if self.training else 0.0,
                    window_size=(-1, -1) if window_size is None else (window_size - 1, 0),
                    causal=True,
                    softmax_scale=self._softmax_scale,
                ).view(*out_dims)
            else:
                raise NotImplementedError("flash_attn_func (one document per row) is not ported")
            input_ = input_.flatten(-2)
        else:
            input_ = self._attn_fused(
                query.flatten(-2),
                key.flatten(-2),
                value.flatten(-2),
                kwargs[AttentionKwargs.attention_mask],
                kwargs[AttentionKwargs.attention_mask_value],
            )
        return self.dense(input_)


# ---- a packed batch as Fast-LLM's GPT data sampler hands it over ----
config = AttentionConfig()
hidden_size = 16
sequence_length = 12
documents_per_row = [[5, 3, 4], [7, 5]]
batch_size = len(documents_per_row)
hidden = torch.randn(batch_size, sequence_length, hidden_size)


def make_kwargs(seq_len, sequence_lengths):
    kwargs = {
        AttentionKwargs.sequence_first: False,
        AttentionKwargs.sequence_length: seq_len,
        AttentionKwargs.sequence_q_dim: TensorDim("sequence_q", seq_len),
        AttentionKwargs.sequence_k_dim: TensorDim("sequence_k", seq_len),
    }
    if sequence_lengths is not None:
        kwargs[AttentionKwargs.sequence_lengths] = [torch.tensor(x, dtype=torch.int64) for x in sequence_lengths]
    return kwargs


backup_layer = Attention(config, hidden_size, block_index=1, use_flash_attention=False).eval()
flash_layer = Attention(config, hidden_size, block_index=1, use_flash_attention=True).eval()
flash_layer.load_state_dict(backup_layer.state_dict())

with torch.no_grad():
    # backup (CPU) implementation over the packed rows
    kwargs = make_kwargs(sequence_length, documents_per_row)
    backup_layer._rotary.preprocess(hidden, kwargs)
    BackupAttentionPreprocessor(config).preprocess(hidden, kwargs)
    out_backup = backup_layer(hidden, kwargs)
    packed_probs = backup_layer.last_probs

    # flash (varlen) implementation over the same packed rows
    kwargs_flash = make_kwargs(sequence_length, documents_per_row)
    flash_layer._rotary.preprocess(hidden, kwargs_flash)
    FlashAttnVarlenPreprocessor(config).preprocess(hidden, kwargs_flash)
    assert kwargs_flash[AttentionKwargs.cu_seqlens_q].tolist() == [0, 5, 8, 12, 19, 24]
    out_flash = flash_layer(hidden, kwargs_flash)

    # reference: each document alone, one row, positions from 0, no packing information
    for row, lengths in enumerate(documents_per_row):
        start = 0
        for length in lengths:
            doc = hidden[row : row + 1, start : start + length]
            ref_layer = Attention(config, hidden_size, block_index=1, use_flash_attention=False).eval()
            ref_layer.load_state_dict(backup_layer.state_dict())
            kw = make_kwargs(length, None)
            ref_layer._rotary.preprocess(doc, kw)
            BackupAttentionPreprocessor(config).preprocess(doc, kw)
            ref = ref_layer(doc, kw)
            torch.testing.assert_close(out_backup[row, start : start + length], ref[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out_flash[row, start : start + length], ref[0], atol=1e-5, rtol=1e-5)

            # double loop over the scores of this document (row positions for rotary, as in the packed run)
            q = backup_layer.query(hidden[row]).view(sequence_length, config.num_attention_heads, config.kv_channels)
            kv = backup_layer.key_value(hidden[row])
            k, _ = kv.split(config.head_groups * config.kv_channels, dim=-1)
            k = k.view(sequence_length, config.head_groups, config.kv_channels)
            q = apply_rotary_embeddings(q[None], kwargs[AttentionKwargs.rotary_freq_q])[0]
            k = apply_rotary_embeddings(k[None], kwargs[AttentionKwargs.rotary_freq_k])[0]
            hpg = config.num_attention_heads // config.head_groups
            for head in range(config.num_attention_heads):
                group, within = divmod(head, hpg)
                for i in range(start, start + length):
                    scores = [
                        float(q[i, head] @ k[j, group]) / math.sqrt(config.kv_channels) for j in range(start, i + 1)
                    ]
                    m = max(scores)
                    exps = [math.exp(s - m) for s in scores]
                    expected = torch.zeros(sequence_length)
                    expected[start : i + 1] = torch.tensor([e / sum(exps) for e in exps])
                    torch.testing.assert_close(packed_probs[row, group, i, within], expected, atol=1e-5, rtol=1e-5)
            start += length

print("Fast-LLM packed documents: backup document mask and varlen cu_seqlens both match each document alone")
