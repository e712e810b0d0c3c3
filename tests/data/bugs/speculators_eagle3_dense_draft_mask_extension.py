"""speculators EAGLE-3 draft model: dense (eager) draft-token mask extension ignores additive semantics.

Citation: vllm-project/speculators#897 "Fix eager-path draft-token mask extension inverting additive
mask semantics" (merged 2026-08-03). PR text: "`extend_dense_mask_for_draft_tokens` appends a 1/0
diagonal block regardless of the input mask's semantics. The eager/SDPA path feeds it the additive
float mask from `create_float_mask` (0 = attend, -inf = blocked), so on every TTT step >= 1 the
appended draft-KV columns are 0.0 off-diagonal (fully attended) and +1.0 on the diagonal (a spurious
score bias). Every query then attends all previous-step draft tokens across document boundaries and
future positions". Fix: "The appended block now follows the input mask's semantics: 0 on the diagonal
and -inf elsewhere for floating-point masks, and the previous True/False (or 1/0) diagonal for boolean
and integral masks."

Bug (pre-fix src/speculators/models/eagle3/attention.py, read from upstream):
    diag = idx.unsqueeze(1) == idx.unsqueeze(0)
    diag = diag.to(dtype=mask.dtype).unsqueeze(0).unsqueeze(0)
    return torch.cat([mask, diag], dim=-1)
Fix: for a floating mask the appended block is `0` on the diagonal and `-inf` elsewhere (written from
the PR description; the fixed function body itself I did not read).

This program: the draft model's TTT loop (`Eagle3DraftModel.forward`) with
`_attn_implementation = "eager"`: a packed row of two documents (`document_ids`), masks from
`create_combined_mask_mod` materialised by `create_float_mask`, three TTT steps whose K/V accumulate
in a DynamicCache-style list, and the mask extended by one diagonal block per step. One decoder layer,
no rotary embedding (it does not touch the mask).
"""
import sys
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.attention.flex_attention import and_masks, create_mask, or_masks

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


def create_combined_mask_mod(document_ids, total_seq_len, sliding_window=None):
    def causal_mask_mod(_b, _h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        if sliding_window is not None:
            causal = causal & (kv_idx > q_idx - sliding_window)
        return causal

    def document_mask_mod(_b, _h, q_idx, kv_idx):
        # Exclude padding tokens in attention mask
        return torch.logical_and(
            document_ids[q_idx] != -1,
            document_ids[q_idx] == document_ids[kv_idx % total_seq_len])

    def diagonal_draft_mask_mod(_b, _h, q_idx, kv_idx):
        return kv_idx % total_seq_len == q_idx

    return or_masks(and_masks(causal_mask_mod, document_mask_mod), diagonal_draft_mask_mod)


def create_float_mask(mask_mod, B=None, H=None, Q_LEN=0, KV_LEN=0, device=None, dtype=torch.bfloat16):
    """Wrap ``create_mask`` and convert the boolean result to a float mask (0 attend, -inf masked)."""
    bool_mask = create_mask(mask_mod, B=B, H=H, Q_LEN=Q_LEN, KV_LEN=KV_LEN, device=device)
    float_mask = torch.zeros(bool_mask.shape, dtype=dtype, device=device)
    float_mask.masked_fill_(~bool_mask, float("-inf"))
    return float_mask


def extend_dense_mask_for_draft_tokens(mask, total_seq_len):
    """Extend a dense attention mask with a diagonal block for new draft tokens."""
    idx = torch.arange(total_seq_len, device=mask.device)
    diag = idx.unsqueeze(1) == idx.unsqueeze(0)
    if FIXED and mask.dtype.is_floating_point:
        block = torch.full(diag.shape, float("-inf"), dtype=mask.dtype, device=mask.device)
        block.masked_fill_(diag, 0.0)
        return torch.cat([mask, block.unsqueeze(0).unsqueeze(0)], dim=-1)
    diag = diag.to(dtype=mask.dtype).unsqueeze(0).unsqueeze(0)
    return torch.cat([mask, diag], dim=-1)


@dataclass
class LlamaLayerConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    _attn_implementation: str = "eager"


@dataclass
class Eagle3SpeculatorConfig:
    transformer_layer_config: LlamaLayerConfig = field(default_factory=LlamaLayerConfig)
    draft_vocab_size: int = 48


def eager_attention_forward(module, query, key, value, attention_mask, scaling):
    key = key.repeat_interleave(module.num_key_value_groups, dim=1)
    value = value.repeat_interleave(module.num_key_value_groups, dim=1)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key.shape[-2]]
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(attn_weights, value).transpose(1, 2).contiguous()


class Eagle3DecoderLayer(nn.Module):
    """First draft layer: attention over [input_embeds, hidden_states] (2 * hidden in)."""

    def __init__(self, config: LlamaLayerConfig, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_kv
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(2 * config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, past_key_values):
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, s, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, s, self.num_kv, self.head_dim).transpose(1, 2)
        if len(past_key_values) > self.layer_idx:
            k = torch.cat([past_key_values[self.layer_idx][0], k], dim=2)
            v = torch.cat([past_key_values[self.layer_idx][1], v], dim=2)
            past_key_values[self.layer_idx] = (k, v)
        else:
            past_key_values.append((k, v))
        out = eager_attention_forward(self, q, k, v, attention_mask, self.scaling)
        return hidden_states[..., -self.o_proj.out_features:] + self.o_proj(out.reshape(b, s, -1))


class Eagle3DraftModel(nn.Module):
    def __init__(self, config: Eagle3SpeculatorConfig):
        super().__init__()
        self.config = config
        self._attn_impl = config.transformer_layer_config._attn_implementation
        h = config.transformer_layer_config.hidden_size
        self.embed_tokens = nn.Embedding(config.draft_vocab_size, h)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(config.transformer_layer_config)])
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)

    def _build_attn_mask(self, document_ids, total_seq_len, device, sliding_window=None):
        mask_mod = create_combined_mask_mod(document_ids, total_seq_len, sliding_window)
        return create_float_mask(mask_mod, B=None, H=None, Q_LEN=total_seq_len, KV_LEN=total_seq_len,
                                 device=device, dtype=torch.float32)

    def forward(self, hidden_states, input_ids, document_ids, ttt_steps=3):
        device = hidden_states.device
        total_seq_len = hidden_states.shape[1]
        past_key_values = []
        full_attn_mask = self._build_attn_mask(document_ids.squeeze(0), total_seq_len, device)
        hidden_states = self.fc(hidden_states)
        original_input_ids = input_ids.detach().clone()
        draft_tokens = []
        for ttt_step in range(ttt_steps):
            input_embeds = self.embed_tokens(input_ids)
            hidden_states = torch.cat([input_embeds, hidden_states], dim=-1)
            for decoder_layer in self.layers:
                hidden_states = decoder_layer(hidden_states, attention_mask=full_attn_mask,
                                              past_key_values=past_key_values)
            logits = self.lm_head(hidden_states)
            input_ids = torch.argmax(logits, dim=-1)
            draft_tokens.append(input_ids)
            # Teacher forcing: feed the ground-truth tokens into the next TTT step, shifted left by
            # 1 + ttt_step and right-padded with 0.
            input_ids = torch.cat([original_input_ids[:, 1 + ttt_step:],
                                   original_input_ids.new_zeros(1, 1 + ttt_step)], dim=-1)
            full_attn_mask = extend_dense_mask_for_draft_tokens(full_attn_mask, total_seq_len)
        return draft_tokens


def main():
    config = Eagle3SpeculatorConfig()
    model = Eagle3DraftModel(config).eval()
    # two packed documents of 5 and 3 tokens (total_seq_len = 8)
    document_ids = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    input_ids = torch.tensor([[3, 17, 8, 21, 5, 40, 2, 11]])
    aux_hidden = torch.randn(1, 8, 3 * config.transformer_layer_config.hidden_size)
    with torch.no_grad():
        drafts = model(aux_hidden, input_ids, document_ids, ttt_steps=3)
    print("draft tokens per TTT step:", [d.squeeze(0).tolist() for d in drafts])


if __name__ == "__main__":
    main()
