# Citation: huggingface/nanotron#343 (commit 26ba5a88, "Fix cuseqlen") moved the cu_seqlens
# computation from Qwen2Attention.forward (where position_ids had been flattened) into
# Qwen2Model.forward, where position_ids is still [batch_size, seq_length]; fixed in
# huggingface/nanotron#341 (commit 1dfee7f5, "new dataloader") by `position_ids.view(-1)`.
# Upstream: src/nanotron/models/qwen.py, Qwen2Model.forward (cu_seqlens) ->
# Qwen2DecoderLayer -> Qwen2Attention._forward_packed -> flash_attn_varlen_kvpacked_func.
# Bug: `torch.where(position_ids == 0)[0]` on the 2-D position_ids returns the ROW index of
# every document start, not its flat token offset, so cu_seqlens ([0, 0, 1, 1, b*s]) no
# longer marks the packed documents: the varlen kernel runs one causal sequence that crosses
# document and even batch-row boundaries.
# Fix: `torch.where(position_ids.view(-1) == 0)[0]` (flat offsets of the document starts).
#
# Tiny CPU port: TP size 1 (the TensorParallel linears are nn.Linear), flash-attn's
# RotaryEmbedding and flash_attn_varlen_kvpacked_func are written below in plain torch with
# flash-attn's call signatures and semantics.
import dataclasses
import math
import sys
from typing import Dict, List, Optional

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)
np.random.seed(0)


# ----------------------------------------------------------------------------------------------
# flash-attn stand-ins (plain torch, same signatures)
# ----------------------------------------------------------------------------------------------
def flash_attn_varlen_kvpacked_func(
    q,  # [total_q, nheads, d]
    kv,  # [total_k, 2, nheads_k, d]
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    total_q, nheads, d = q.shape
    nheads_k = kv.shape[2]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    out = q.new_zeros(total_q, nheads, d)
    nseq = cu_seqlens_q.numel() - 1
    for i in range(nseq):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        sq, sk = qe - qs, ke - ks
        if sq == 0 or sk == 0:
            continue
        qi = q[qs:qe].transpose(0, 1)  # [h, sq, d]
        ki = kv[ks:ke, 0].transpose(0, 1)  # [hk, sk, d]
        vi = kv[ks:ke, 1].transpose(0, 1)
        rep = nheads // nheads_k
        ki = ki.repeat_interleave(rep, dim=0)
        vi = vi.repeat_interleave(rep, dim=0)
        scores = torch.matmul(qi, ki.transpose(-1, -2)) * softmax_scale
        if causal:
            # flash-attn >= 2.1: causal mask aligned to the bottom-right corner
            row = torch.arange(sq).unsqueeze(1) + (sk - sq)
            col = torch.arange(sk).unsqueeze(0)
            scores = scores.masked_fill(col > row, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(qi.dtype)
        out[qs:qe] = torch.matmul(probs, vi).transpose(0, 1)
    return out


class FlashRotaryEmbedding(nn.Module):
    """flash_attn.layers.rotary.RotaryEmbedding (non-interleaved), applied to q and kv[:, :, 0]."""

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False):
        super().__init__()
        self.dim = dim
        self.base = base
        self.interleaved = interleaved
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _cos_sin(self, seqlen):
        t = torch.arange(seqlen, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        return torch.cos(freqs), torch.sin(freqs)

    @staticmethod
    def _apply(x, cos, sin):  # x [b, s, h, d]
        d2 = cos.shape[-1]
        x1, x2 = x[..., :d2], x[..., d2 : 2 * d2]
        c = cos[None, :, None, :]
        s = sin[None, :, None, :]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)

    def forward(self, q, kv, seqlen_offset=0, max_seqlen=None):
        seqlen = q.shape[1]
        cos, sin = self._cos_sin(seqlen + seqlen_offset)
        cos, sin = cos[seqlen_offset:], sin[seqlen_offset:]
        q = self._apply(q, cos, sin)
        k = self._apply(kv[:, :, 0], cos, sin)
        kv = torch.stack([k, kv[:, :, 1]], dim=2)
        return q, kv


# ----------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Qwen2Config:
    vocab_size: int = 96
    hidden_size: int = 32
    intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    attention_bias: bool = False
    _use_qkv_packed: bool = True
    no_rope_layer: Optional[int] = None
    pad_token_id: Optional[int] = None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


# ----------------------------------------------------------------------------------------------
# model (src/nanotron/models/qwen.py, tp size 1)
# ----------------------------------------------------------------------------------------------
class Qwen2Attention(nn.Module):
    def __init__(self, config: Qwen2Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.local_num_heads = self.num_heads
        self.num_kv_heads = config.num_key_value_heads
        self.local_num_kv_heads = self.num_kv_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(self.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = FlashRotaryEmbedding(
            dim=self.head_dim, base=config.rope_theta, interleaved=config.rope_interleaved
        )
        self.simple_causal_mask = True
        self._use_qkv_packed = config._use_qkv_packed

    def forward(
        self,
        hidden_states: torch.Tensor,  # [batch_size*seq_length, hidden_size]
        position_ids: torch.Tensor,  # [batch_size, seq_length]
        cu_seqlens: Optional[torch.Tensor] = None,
    ):
        seq_length = position_ids.shape[1]
        position_ids = position_ids.view(-1)  # [batch_size*seq_length]
        qkv = self.qkv_proj(hidden_states)
        attn_output = self._forward_packed(qkv, seq_length, position_ids, cu_seqlens)
        output = self.o_proj(attn_output)
        return {"hidden_states": output, "position_ids": position_ids.view(-1, seq_length)}

    def _forward_packed(self, qkv, seq_length, position_ids, cu_seqlens):
        assert cu_seqlens is not None, "cu_seqlens must be provided for packed attention"
        q = qkv[..., : self.local_num_heads * self.head_dim]
        kv = qkv[..., self.local_num_heads * self.head_dim :]
        q = q.reshape(-1, seq_length, self.local_num_heads, self.head_dim)
        kv = kv.reshape(-1, seq_length, 2, self.local_num_kv_heads, self.head_dim)
        if self.config.no_rope_layer is None or (self.layer_idx + 1) % self.config.no_rope_layer != 0:
            q, kv = self.rotary_emb(q, kv, seqlen_offset=0, max_seqlen=None)
        q = q.reshape(-1, self.local_num_heads, self.head_dim)
        kv = kv.reshape(-1, 2, self.local_num_kv_heads, self.head_dim)
        max_seqlen = seq_length

        assert cu_seqlens.dtype == torch.int32
        assert max_seqlen is not None
        assert isinstance(max_seqlen, int)
        attn_output = flash_attn_varlen_kvpacked_func(
            q,
            kv,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            0.0,
            softmax_scale=None,
            causal=True,
            alibi_slopes=None,
            window_size=(-1, -1),
            deterministic=False,
        )
        return attn_output.reshape(-1, self.local_num_heads * self.head_dim)


class Qwen2MLP(nn.Module):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        merged = self.gate_up_proj(hidden_states)
        gate, up = merged.chunk(2, dim=-1)
        return {"hidden_states": self.down_proj(F.silu(gate) * up)}


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: Qwen2Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = Qwen2Attention(config=config, layer_idx=layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen2MLP(config)

    def _core_forward(self, hidden_states, position_ids, cu_seqlens):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        output = self.attn(hidden_states=hidden_states, position_ids=position_ids, cu_seqlens=cu_seqlens)
        hidden_states = output["hidden_states"]
        hidden_states = hidden_states + residual

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states=hidden_states)["hidden_states"]
        hidden_states = hidden_states + residual
        return hidden_states, position_ids, cu_seqlens

    def forward(self, hidden_states, position_ids, cu_seqlens) -> Dict[str, torch.Tensor]:
        hidden_states, position_ids, cu_seqlens = self._core_forward(hidden_states, position_ids, cu_seqlens)
        return {"hidden_states": hidden_states, "position_ids": position_ids, "cu_seqlens": cu_seqlens}


class Embedding(nn.Module):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        input_ids = input_ids.view(-1)
        input_embeds = self.token_embedding(input_ids)
        return {"input_embeds": input_embeds, "position_ids": position_ids}


class Qwen2Model(nn.Module):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.config = config
        self.token_position_embeddings = Embedding(config)
        self.decoder = nn.ModuleList(
            [Qwen2DecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.final_layer_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [batch_size, seq_length]
        position_ids: torch.Tensor,  # [batch_size, seq_length]
    ):
        output = self.token_position_embeddings(input_ids=input_ids, position_ids=position_ids)
        # Compute cu_seqlens
        if position_ids.numel() > 0:
            if FIXED:
                start_indices = torch.where(position_ids.view(-1) == 0)[0]
            else:
                start_indices = torch.where(position_ids == 0)[0]
            cu_seqlens = torch.cat(
                [start_indices, torch.tensor([position_ids.numel()], dtype=torch.int32, device=start_indices.device)]
            ).to(torch.int32)
        else:
            cu_seqlens = None

        decoder_states = {
            "hidden_states": output["input_embeds"],
            "position_ids": output["position_ids"],
            "cu_seqlens": cu_seqlens,
        }
        for decoder_layer in self.decoder:
            decoder_states = decoder_layer(**decoder_states)

        hidden_states = self.final_layer_norm(decoder_states["hidden_states"])
        sharded_logits = self.lm_head(hidden_states)
        return sharded_logits, cu_seqlens


def masked_mean(loss, label_mask, dtype):
    return (loss * label_mask).sum(dtype=dtype) / label_mask.sum()


class Loss(nn.Module):
    def forward(self, sharded_logits, label_ids, label_mask):
        sharded_logits = sharded_logits.view(label_ids.shape[0], label_ids.shape[1], -1)
        loss = F.cross_entropy(
            sharded_logits.float().reshape(-1, sharded_logits.shape[-1]), label_ids.reshape(-1), reduction="none"
        ).view_as(label_ids)
        return {"loss": masked_mean(loss, label_mask, dtype=torch.float)}


# ----------------------------------------------------------------------------------------------
# data: src/nanotron/data/clm_collator.py DataCollatorForCLMWithPositionIds (pp/cp size 1)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DataCollatorForCLMWithPositionIds:
    sequence_length: int

    def __call__(self, examples: List[Dict[str, np.ndarray]]) -> Dict[str, torch.Tensor]:
        input_ids = np.vstack([examples[i]["input_ids"] for i in range(len(examples))])  # (b, s+1)
        batch_size, expanded_input_length = input_ids.shape
        assert expanded_input_length == self.sequence_length + 1
        result = {}
        result["input_ids"] = input_ids[:, :-1]
        position_ids = np.vstack([examples[i]["positions"] for i in range(len(examples))])
        result["position_ids"] = position_ids[:, :-1]

        result["label_ids"] = input_ids[:, 1:]
        position_ids = position_ids[:, 1:]
        result["label_mask"] = np.ones((batch_size, self.sequence_length), dtype=np.bool_)
        zeros = position_ids == 0
        result["label_mask"] &= ~zeros
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in result.items()}


def make_packed_example(doc_lens, vocab_size, eos_id, rng):
    ids, pos = [], []
    for n in doc_lens:
        doc = list(rng.integers(3, vocab_size, size=n - 1)) + [eos_id]
        ids += doc
        pos += list(range(n))
    return {"input_ids": np.array(ids, dtype=np.int64), "positions": np.array(pos, dtype=np.int64)}


def main():
    config = Qwen2Config()
    seq_len = 16
    rng = np.random.default_rng(0)
    # micro batch of 2 packed rows (seq_len + 1 tokens each), documents end with eos (id 2)
    examples = [
        make_packed_example([10, 7], config.vocab_size, eos_id=2, rng=rng),
        make_packed_example([5, 12], config.vocab_size, eos_id=2, rng=rng),
    ]
    batch = DataCollatorForCLMWithPositionIds(sequence_length=seq_len)(examples)

    model = Qwen2Model(config)
    loss_fn = Loss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    print("position_ids:", batch["position_ids"].tolist())
    for step in range(3):
        logits, cu_seqlens = model(batch["input_ids"], batch["position_ids"])
        if step == 0:
            print("cu_seqlens:", cu_seqlens.tolist())
            lg = logits.view(2, seq_len, -1)
            print("row 1 logits[0, :4] (first token of row 1):", [round(x, 4) for x in lg[1, 0, :4].tolist()])
            print("row 0 logits[12, :4] (3rd token of doc 2):", [round(x, 4) for x in lg[0, 12, :4].tolist()])
        loss = loss_fn(logits, batch["label_ids"], batch["label_mask"])["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
