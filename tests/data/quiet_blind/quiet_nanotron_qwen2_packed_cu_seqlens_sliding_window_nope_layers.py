"""nanotron Qwen2 pre-training on packed documents: cu_seqlens from position_ids, a sliding window, NoPE layers.

Correct program (quiet batch quiet-r163b).  Ported from huggingface/nanotron
@2411b022a75fb7f7561a1bb4166706da5e1b76de (qwen.py last changed by 7bc99232, "SmolLM3 training"):
src/nanotron/models/qwen.py (Qwen2Model.forward builds cu_seqlens from `position_ids == 0` over the flattened
batch; Qwen2Attention._forward_packed applies FlashRotaryEmbedding over the row (seqlen_offset 0, no per-document
positions), skips RoPE and the sliding window on every `no_rope_layer`-th layer, and calls
flash_attn_varlen_kvpacked_func(causal=True, window_size=(sliding_window_size - 1, 0)); Loss / masked_mean),
src/nanotron/data/clm_collator.py (DataCollatorForCLMWithPositionIds: inputs and positions drop the last token,
label_mask drops each label whose position is 0), and huggingface/datatrove
@a649de79c14a550dc90f48a15c025f2dd3fd3b57 src/datatrove/utils/dataset.py
(DatatroveFileDataset._get_positions_from_tokens: positions restart after each EOS and at the window start).
Tensor/pipeline parallel layers become nn.Linear / nn.Embedding (tp = pp = cp = 1); flash-attn needs CUDA, so a
plain-torch stand-in with flash_attn_varlen_kvpacked_func's signature and mask semantics is used.

Check: a token stream of EOS-terminated documents is cut into windows of seq_len + 1 tokens as datatrove does, two
windows are collated into one batch and run through a tiny GQA model (4 layers, NoPE on layers 2 and 4, window 3)
in float64. Every input position's logits equal an independent reference: each document fragment of a row run
alone by a hand-written model (RoPE at positions 0.. of the fragment, attention as a double loop over query/key
pairs: causal, last 3 keys on RoPE layers, the whole fragment prefix on NoPE layers). The loss equals the mean
cross-entropy over the targets that stay inside a document (a target is dropped when its input token is EOS).
"""
import dataclasses
import math
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


@dataclasses.dataclass
class Qwen2Config:
    bos_token_id: int = 1
    eos_token_id: int = 2
    hidden_act: str = "silu"
    hidden_size: int = 32
    intermediate_size: int = 64
    max_position_embeddings: int = 64
    num_attention_heads: int = 4
    num_hidden_layers: int = 4
    num_key_value_heads: Optional[int] = 2
    pad_token_id: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    vocab_size: int = 48
    _attn_implementation: str = "flash_attention_2"
    attention_bias: bool = False
    sliding_window_size: Optional[int] = 3
    no_rope_layer: Optional[int] = 2  # Skip rope every no_rope_layer layers
    _use_qkv_packed: bool = True
    log_attn_probs: bool = False

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.sliding_window_size is not None:
            assert self._attn_implementation in ["flex_attention", "flash_attention_2", "llama3_ring_attention"]
        if self.no_rope_layer is not None:
            assert self.num_hidden_layers % self.no_rope_layer == 0


# --- datatrove: DatatroveFileDataset (positions from the EOS token id) -------------------------------------------
class DatatroveFileDataset:
    def __init__(self, tokens: np.ndarray, seq_len: int, return_positions: bool, positions_from_eos_token_id: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.return_positions = return_positions
        self.positions_from_eos_token_id = positions_from_eos_token_id

    def _get_positions_from_tokens(self, tokens):
        pos = torch.ones_like(tokens, dtype=torch.int64)
        doc_ends = torch.cat(
            [
                torch.tensor([0], dtype=torch.int64),
                torch.where(tokens[:-1] == self.positions_from_eos_token_id)[0] + 1,
            ]
        )
        prev_ends = torch.cat([torch.tensor([-1], dtype=torch.int64), doc_ends[:-1]])
        offsets = prev_ends - doc_ends + 1
        pos[doc_ends] = offsets
        return torch.cumsum(pos, dim=0)

    def _get_input_ids(self, item):
        chunk_size = self.seq_len + 1
        return torch.as_tensor(self.tokens[item * chunk_size : (item + 1) * chunk_size].astype(np.int64))

    def __getitem__(self, item):
        data = {"input_ids": self._get_input_ids(item)}
        if self.return_positions:
            data["positions"] = self._get_positions_from_tokens(data["input_ids"])
            assert data["positions"][0] == 0, "First position should be 0"
        return data

    def __len__(self):
        return len(self.tokens) // (self.seq_len + 1)


# --- nanotron: DataCollatorForCLMWithPositionIds (pp = cp = 1) ----------------------------------------------------
@dataclasses.dataclass
class DataCollatorForCLMWithPositionIds:
    sequence_length: int
    use_doc_masking: bool = True

    def __call__(self, examples: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
        input_ids = np.vstack([examples[i]["input_ids"] for i in range(len(examples))])  # (b, s)
        batch_size, expanded_input_length = input_ids.shape
        result: Dict[str, np.ndarray] = {}
        assert expanded_input_length == self.sequence_length + 1

        result["input_ids"] = input_ids[:, :-1]
        if "positions" in examples[0] and self.use_doc_masking:
            position_ids = np.vstack([examples[i]["positions"] for i in range(len(examples))])
            result["positions"] = position_ids[:, :-1]
        else:
            result["positions"] = np.arange(self.sequence_length)[None, :].repeat(batch_size, axis=0)
        result["position_ids"] = result.pop("positions")

        result["label_ids"] = input_ids[:, 1:]
        if "positions" in examples[0] and self.use_doc_masking:
            position_ids = np.vstack([examples[i]["positions"] for i in range(len(examples))])
            position_ids = position_ids[:, 1:]  # Shift right to align with labels
            result["label_mask"] = np.ones((batch_size, self.sequence_length), dtype=np.bool_)
            zeros = position_ids == 0
            result["label_mask"] &= ~zeros
        else:
            result["label_mask"] = np.ones((batch_size, self.sequence_length), dtype=np.bool_)
        return result


# --- flash-attn stand-ins ----------------------------------------------------------------------------------------
def flash_attn_varlen_kvpacked_func(
    q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, alibi_slopes=None, window_size=(-1, -1), deterministic=False, return_attn_probs=False,
):
    """Plain-torch stand-in: q (total_q, h, d), kv (total_k, 2, h_k, d); each cu_seqlens segment attends alone."""
    out = torch.empty_like(q)
    nheads, nheads_k = q.shape[1], kv.shape[2]
    left, right = window_size
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        sq, sk = qe - qs, ke - ks
        qb = q[qs:qe].transpose(0, 1)  # (h, sq, d)
        kb = kv[ks:ke, 0].transpose(0, 1).repeat_interleave(nheads // nheads_k, dim=0)
        vb = kv[ks:ke, 1].transpose(0, 1).repeat_interleave(nheads // nheads_k, dim=0)
        i = torch.arange(sq)[:, None] + (sk - sq)  # bottom-right aligned
        j = torch.arange(sk)[None, :]
        allowed = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            allowed &= j <= i
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=softmax_scale)
        out[qs:qe] = ob.transpose(0, 1)
    return out


class FlashRotaryEmbedding(nn.Module):
    """flash_attn.layers.rotary.RotaryEmbedding.forward(q, kv, seqlen_offset, max_seqlen), non-interleaved."""

    def __init__(self, dim: int, base=10000.0, interleaved=False, seq_len_interpolation_factor=None):
        super().__init__()
        assert not interleaved
        self.dim = dim
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)))
        self.seq_len_interpolation_factor = seq_len_interpolation_factor

    def _apply_rotary(self, x, cos, sin):  # x (b, s, h, d)
        x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2 :]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)

    def forward(self, q, kv, seqlen_offset=0, max_seqlen=None):
        seqlen = q.shape[1]
        t = torch.arange(seqlen_offset + seqlen, dtype=torch.float64)
        if self.seq_len_interpolation_factor is not None:
            t *= 1 / self.seq_len_interpolation_factor
        freqs = torch.outer(t, self.inv_freq)
        cos, sin = torch.cos(freqs)[seqlen_offset:], torch.sin(freqs)[seqlen_offset:]
        q = self._apply_rotary(q, cos, sin)
        k = self._apply_rotary(kv[:, :, 0], cos, sin)
        kv = torch.stack([k, kv[:, :, 1]], dim=2)
        return q, kv


# --- nanotron: Qwen2 ---------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, input):
        variance = input.pow(2).mean(-1, keepdim=True)
        return self.weight * (input * torch.rsqrt(variance + self.eps))


class Qwen2Attention(nn.Module):
    def __init__(self, config: Qwen2Config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.cp_pg_size = 1
        self.num_heads = config.num_attention_heads
        self.local_num_heads = self.num_heads
        self.num_kv_heads = config.num_key_value_heads
        self.local_num_kv_heads = self.num_kv_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = FlashRotaryEmbedding(dim=self.head_dim, base=config.rope_theta,
                                               interleaved=config.rope_interleaved)
        self._use_qkv_packed = config._use_qkv_packed
        self.sliding_window_size = config.sliding_window_size
        self.log_attn_probs = config.log_attn_probs

    def forward(self, hidden_states, position_ids, cu_seqlens=None):
        seq_length = position_ids.shape[1] // self.cp_pg_size
        position_ids = position_ids.view(-1)  # [batch_size*seq_length]
        qkv = self.qkv_proj(hidden_states)
        attn_output = self._forward_packed(qkv, seq_length, position_ids, cu_seqlens)
        output = self.o_proj(attn_output)
        return {"hidden_states": output, "position_ids": position_ids.view(-1, seq_length)}

    def _forward_packed(self, qkv, seq_length, position_ids, cu_seqlens):
        assert cu_seqlens is not None, "cu_seqlens must be provided for packed attention"
        q = qkv[..., : self.local_num_heads * self.head_dim]
        kv = qkv[..., self.local_num_heads * self.head_dim :]
        q = q.view(-1, seq_length, self.local_num_heads, self.head_dim)
        kv = kv.view(-1, seq_length, 2, self.local_num_kv_heads, self.head_dim)
        if self.config.no_rope_layer is None or (self.layer_idx + 1) % self.config.no_rope_layer != 0:
            seqlen_offset = 0 * seq_length  # dist.get_rank(self.cp_pg) * seq_length, cp = 1
            q, kv = self.rotary_emb(q, kv, seqlen_offset=seqlen_offset, max_seqlen=seq_length * self.cp_pg_size)
        else:
            self.sliding_window_size = None  # WARNING: we skip sliding window for no-rope

        q = q.reshape(-1, self.local_num_heads, self.head_dim)
        kv = kv.reshape(-1, 2, self.local_num_kv_heads, self.head_dim)
        max_seqlen = seq_length

        assert cu_seqlens.dtype == torch.int32
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
            window_size=(self.sliding_window_size - 1, 0) if self.sliding_window_size is not None else (-1, -1),
            deterministic=False,
            return_attn_probs=self.log_attn_probs,
        )
        return attn_output.reshape(-1, self.local_num_heads * self.head_dim)


class Qwen2MLP(nn.Module):
    def __init__(self, config: Qwen2Config, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act = F.silu

    def forward(self, hidden_states):
        merged_states = self.gate_up_proj(hidden_states)
        gate_states, up_states = torch.split(merged_states, merged_states.shape[-1] // 2, dim=-1)
        hidden_states = self.act(gate_states) * up_states
        return {"hidden_states": self.down_proj(hidden_states)}


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: Qwen2Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = Qwen2Attention(config=config, layer_idx=layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen2MLP(config=config, intermediate_size=config.intermediate_size)

    def forward(self, hidden_states, position_ids, cu_seqlens):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        output = self.attn(hidden_states=hidden_states, position_ids=position_ids, cu_seqlens=cu_seqlens)
        hidden_states = output["hidden_states"] + residual
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states=hidden_states)["hidden_states"] + residual
        return {"hidden_states": hidden_states, "position_ids": position_ids, "cu_seqlens": cu_seqlens}


class Embedding(nn.Module):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)

    def forward(self, input_ids, position_ids):
        input_ids = input_ids.view(-1)  # [batch_size*seq_length]
        return {"input_embeds": self.token_embedding(input_ids), "position_ids": position_ids}


class Qwen2Model(nn.Module):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.config = config
        self.token_position_embeddings = Embedding(config)
        self.decoder = nn.ModuleList(
            [Qwen2DecoderLayer(config=config, layer_idx=layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.final_layer_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, position_ids):
        output = self.token_position_embeddings(input_ids=input_ids, position_ids=position_ids)
        cu_seqlens = None
        if position_ids.numel() > 0:
            start_indices = torch.where(position_ids.view(-1) == 0)[0]
            cu_seqlens = torch.cat(
                [start_indices, torch.tensor([position_ids.numel()], dtype=torch.int32, device=start_indices.device)]
            ).to(torch.int32)

        decoder_states = {
            "hidden_states": output["input_embeds"],
            "position_ids": output["position_ids"],
            "cu_seqlens": cu_seqlens,
        }
        for decoder_layer in self.decoder:
            decoder_states = decoder_layer(**decoder_states)
        hidden_states = self.final_layer_norm(decoder_states["hidden_states"])
        return self.lm_head(hidden_states)


def masked_mean(loss, label_mask, dtype):
    return (loss * label_mask).sum(dtype=dtype) / label_mask.sum()


class Loss(nn.Module):
    def forward(self, sharded_logits, label_ids, label_mask):
        sharded_logits = sharded_logits.view(label_ids.shape[0], label_ids.shape[1], -1)
        loss = F.cross_entropy(sharded_logits.transpose(1, 2), label_ids.contiguous(), reduction="none")
        return {"loss": masked_mean(loss, label_mask, dtype=torch.float64)}


class Qwen2ForTraining(nn.Module):
    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.model = Qwen2Model(config=config)
        self.loss = Loss()
        self.config = config

    def forward(self, input_ids, position_ids, label_ids, label_mask):
        sharded_logits = self.model(input_ids=input_ids, position_ids=position_ids)
        loss = self.loss(sharded_logits=sharded_logits, label_ids=label_ids, label_mask=label_mask)
        return {"loss": loss["loss"], "logits": sharded_logits}


# --- independent reference: each document fragment alone, attention as a double loop -----------------------------
def reference_fragment_logits(model: Qwen2ForTraining, cfg: Qwen2Config, tokens: List[int]) -> torch.Tensor:
    m = model.model
    H, KVH = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // H
    n = len(tokens)
    x = m.token_position_embeddings.token_embedding.weight[torch.tensor(tokens)].clone()

    def rms(v, w):
        return w * v / torch.sqrt((v * v).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rope(vec, pos):  # vec (d,), rotate pair (p, p + d/2) by pos * theta^(-2p/d)
        out = vec.clone()
        for p in range(d // 2):
            ang = pos * cfg.rope_theta ** (-2.0 * p / d)
            a, b = vec[p], vec[p + d // 2]
            out[p] = a * math.cos(ang) - b * math.sin(ang)
            out[p + d // 2] = a * math.sin(ang) + b * math.cos(ang)
        return out

    for li, layer in enumerate(m.decoder):
        uses_rope = (li + 1) % cfg.no_rope_layer != 0
        window = cfg.sliding_window_size if uses_rope else None
        h = rms(x, layer.input_layernorm.weight)
        W = layer.attn.qkv_proj.weight
        q_all = h @ W[: H * d].T
        k_all = h @ W[H * d : H * d + KVH * d].T
        v_all = h @ W[H * d + KVH * d :].T
        att = torch.zeros(n, H * d)
        for head in range(H):
            kvh = head // (H // KVH)
            qs = [q_all[t, head * d : (head + 1) * d] for t in range(n)]
            ks = [k_all[t, kvh * d : (kvh + 1) * d] for t in range(n)]
            if uses_rope:
                qs = [rope(qs[t], t) for t in range(n)]
                ks = [rope(ks[t], t) for t in range(n)]
            for i in range(n):
                keys = [j for j in range(n) if j <= i and (window is None or i - j < window)]
                scores = torch.stack([torch.dot(qs[i], ks[j]) / math.sqrt(d) for j in keys])
                probs = torch.softmax(scores, dim=0)
                acc = torch.zeros(d)
                for p, j in zip(probs, keys):
                    acc = acc + p * v_all[j, kvh * d : (kvh + 1) * d]
                att[i, head * d : (head + 1) * d] = acc
        x = x + att @ layer.attn.o_proj.weight.T
        h2 = rms(x, layer.post_attention_layernorm.weight)
        gu = h2 @ layer.mlp.gate_up_proj.weight.T
        g, u = gu[:, : cfg.intermediate_size], gu[:, cfg.intermediate_size :]
        x = x + (F.silu(g) * u) @ layer.mlp.down_proj.weight.T
    return rms(x, m.final_layer_norm.weight) @ m.lm_head.weight.T


def main():
    cfg = Qwen2Config()
    seq_len = 16
    eos = cfg.eos_token_id

    # a tokenized stream of documents, each ending with EOS, as datatrove writes it
    rng = np.random.default_rng(0)
    doc_lengths = [5, 2, 9, 4, 7, 1, 3, 12, 6, 3]
    stream = []
    for length in doc_lengths:
        stream += list(rng.integers(3, cfg.vocab_size, size=length - 1)) + [eos]
    stream = np.array(stream, dtype=np.uint16)

    dataset = DatatroveFileDataset(stream, seq_len=seq_len, return_positions=True, positions_from_eos_token_id=eos)
    assert len(dataset) >= 2
    examples = [{k: v.numpy() for k, v in dataset[i].items()} for i in range(2)]
    collator = DataCollatorForCLMWithPositionIds(sequence_length=seq_len)
    batch = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in collator(examples).items()}

    model = Qwen2ForTraining(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        out = model(batch["input_ids"], batch["position_ids"], batch["label_ids"], batch["label_mask"])

    logits = out["logits"].view(2, seq_len, -1)
    ref_logits = torch.zeros_like(logits)
    ref_losses = []
    fragments_longer_than_window = 0
    with torch.no_grad():
        for b in range(2):
            window_tokens = examples[b]["input_ids"].tolist()  # seq_len + 1 tokens
            inputs = window_tokens[:seq_len]
            start = 0
            for t in range(seq_len):
                if inputs[t] == eos or t == seq_len - 1:  # a fragment ends at EOS or at the row's end
                    frag = inputs[start : t + 1]
                    fragments_longer_than_window += len(frag) > cfg.sliding_window_size
                    ref_logits[b, start : t + 1] = reference_fragment_logits(model, cfg, frag)
                    start = t + 1
            for t in range(seq_len):
                if inputs[t] != eos:  # the next token belongs to the same document
                    ref_losses.append(F.cross_entropy(ref_logits[b, t][None], torch.tensor([window_tokens[t + 1]])))
    ref_loss = torch.stack(ref_losses).mean()

    assert fragments_longer_than_window >= 2
    assert int((batch["position_ids"] == 0).sum()) >= 5
    max_err = (logits - ref_logits).abs().max().item()
    assert max_err < 1e-9, max_err
    assert abs(out["loss"].item() - ref_loss.item()) < 1e-9, (out["loss"].item(), ref_loss.item())
    print("position_ids:", batch["position_ids"].tolist())
    print(f"logits match per-document reference (max err {max_err:.2e}); loss {out['loss'].item():.6f}")


if __name__ == "__main__":
    main()
