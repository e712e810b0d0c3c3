# Citation: Synthyra/FastPLMs commit dc891b3 ("fixing ankh"), fastplms/ankh/modeling_ankh.py, AnkhSelfAttention.forward
#   (written up as "Bug 3" in docs/parity_findings.md of the same commit).
# Bug: layer 0 folds the (B, 1, 1, L) bool key-padding mask into the T5 relative position bias with
#   attention_mask_4d.masked_fill(~attention_mask_4d, -inf); on a bool tensor -inf casts to True, so the result is all
#   True and adds +1.0 everywhere: padded residues stay attended by every residue in every layer.
# Fix: build a float additive mask (zeros, -inf at padded keys) and add that to position_bias. The same commit also set
#   self.scale to 1.0 (T5 attention is unscaled); that part does not touch the mask and is left as before here.
import math
import sys
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


class FastAnkhConfig:
    model_type = "fast_ankh"

    def __init__(self, vocab_size=144, d_model=768, d_kv=64, d_ff=3072, num_heads=12, num_layers=48,
                 relative_attention_num_buckets=64, relative_attention_max_distance=128, dense_act_fn="gelu_new",
                 layer_norm_epsilon=1e-6, initializer_factor=1.0, pad_token_id=0, eos_token_id=1,
                 attn_backend="sdpa"):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.d_kv = d_kv
        self.d_ff = d_ff
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.dense_act_fn = dense_act_fn
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_factor = initializer_factor
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.attn_backend = attn_backend


def get_attention_mask(batch_size: int, seq_len: int, device: torch.device,
                       attention_mask: Optional[torch.Tensor] = None):
    """SDPA path of fastplms.attention.get_attention_mask."""
    if attention_mask is None:
        return None, None, None
    attention_mask_2d = attention_mask.bool()
    # SDPA / manual -- only mask the key dimension so padding query positions attend to
    # real keys and produce valid (non-NaN) outputs instead of NaN from softmax(-inf,...,-inf).
    attention_mask_4d = attention_mask_2d[:, None, None, :]
    return attention_mask_2d, attention_mask_4d, None


class AnkhRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(self.weight.dtype)


def _gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class AnkhGatedFFN(nn.Module):
    def __init__(self, config: FastAnkhConfig):
        super().__init__()
        self.wi_0 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.act = F.silu if config.dense_act_fn == "silu" else _gelu_new

    def forward(self, hidden_states):
        return self.wo(self.act(self.wi_0(hidden_states)) * self.wi_1(hidden_states))


class AnkhSelfAttention(nn.Module):
    def __init__(self, config: FastAnkhConfig, has_relative_attention_bias: bool = False):
        super().__init__()
        self.num_heads = config.num_heads
        self.d_kv = config.d_kv
        self.inner_dim = self.num_heads * self.d_kv
        self.has_relative_attention_bias = has_relative_attention_bias
        self.relative_attention_num_buckets = config.relative_attention_num_buckets
        self.relative_attention_max_distance = config.relative_attention_max_distance
        self.q = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(config.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, config.d_model, bias=False)
        self.scale = self.d_kv ** -0.5
        if self.has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_heads)
        self.attn_backend = "sdpa"

    @staticmethod
    def _relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
        num_buckets //= 2
        relative_buckets = (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact
        relative_position_if_large = max_exact + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        relative_position_if_large = torch.clamp(relative_position_if_large, max=num_buckets - 1)
        relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
        return relative_buckets

    def compute_bias(self, query_length: int, key_length: int, device: torch.device) -> torch.Tensor:
        context_position = torch.arange(query_length, dtype=torch.long, device=device)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long, device=device)[None, :]
        relative_position = memory_position - context_position
        buckets = self._relative_position_bucket(
            relative_position,
            num_buckets=self.relative_attention_num_buckets,
            max_distance=self.relative_attention_max_distance,
        )
        values = self.relative_attention_bias(buckets)  # (Q, K, H)
        return values.permute(2, 0, 1).unsqueeze(0)  # (1, H, Q, K)

    def forward(self, hidden_states, attention_mask_2d=None, attention_mask_4d=None, position_bias=None):
        batch_size, seq_length = hidden_states.shape[:2]
        hidden_shape = (batch_size, seq_length, self.num_heads, self.d_kv)
        query_BHLD = self.q(hidden_states).view(hidden_shape).transpose(1, 2)
        key_BHLD = self.k(hidden_states).view(hidden_shape).transpose(1, 2)
        value_BHLD = self.v(hidden_states).view(hidden_shape).transpose(1, 2)

        if position_bias is None and self.has_relative_attention_bias:
            position_bias = self.compute_bias(seq_length, seq_length, hidden_states.device)
            if attention_mask_4d is not None:
                if FIXED:
                    mask_additive = torch.zeros(
                        attention_mask_4d.shape,
                        dtype=position_bias.dtype,
                        device=position_bias.device,
                    )
                    mask_additive.masked_fill_(attention_mask_4d.logical_not(), float("-inf"))
                    position_bias = position_bias + mask_additive
                else:
                    position_bias = position_bias + attention_mask_4d.masked_fill(
                        attention_mask_4d.logical_not(), float("-inf")
                    )

        attn_output = self._sdpa_attn(query_BHLD, key_BHLD, value_BHLD, position_bias)
        return self.o(attn_output), None, position_bias

    def _sdpa_attn(self, query_BHLD, key_BHLD, value_BHLD, position_bias):
        context_BHLD = F.scaled_dot_product_attention(
            query_BHLD, key_BHLD, value_BHLD,
            attn_mask=position_bias,
            scale=self.scale,
        )
        return context_BHLD.transpose(1, 2).contiguous().view(query_BHLD.shape[0], -1, self.inner_dim)


class AnkhSelfAttentionLayer(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.SelfAttention = AnkhSelfAttention(config, has_relative_attention_bias)
        self.layer_norm = AnkhRMSNorm(config.d_model, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states, attention_mask_2d=None, attention_mask_4d=None, position_bias=None):
        normed = self.layer_norm(hidden_states)
        attn_output, attn_weights, position_bias = self.SelfAttention(
            normed, attention_mask_2d=attention_mask_2d, attention_mask_4d=attention_mask_4d,
            position_bias=position_bias,
        )
        hidden_states = hidden_states + attn_output
        return hidden_states, attn_weights, position_bias


class AnkhFFLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.DenseReluDense = AnkhGatedFFN(config)
        self.layer_norm = AnkhRMSNorm(config.d_model, eps=config.layer_norm_epsilon)

    def forward(self, hidden_states):
        normed = self.layer_norm(hidden_states)
        return hidden_states + self.DenseReluDense(normed)


class AnkhBlock(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False):
        super().__init__()
        self.layer = nn.ModuleList([AnkhSelfAttentionLayer(config, has_relative_attention_bias), AnkhFFLayer(config)])

    def forward(self, hidden_states, attention_mask_2d=None, attention_mask_4d=None, position_bias=None):
        hidden_states, attn_weights, position_bias = self.layer[0](
            hidden_states, attention_mask_2d=attention_mask_2d, attention_mask_4d=attention_mask_4d,
            position_bias=position_bias,
        )
        hidden_states = self.layer[1](hidden_states)
        return hidden_states, attn_weights, position_bias


class FAST_ANKH_ENCODER(nn.Module):
    def __init__(self, config: FastAnkhConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.block = nn.ModuleList([AnkhBlock(config, has_relative_attention_bias=(i == 0))
                                    for i in range(config.num_layers)])
        self.final_layer_norm = AnkhRMSNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.apply(self._init_weights)

    @torch.no_grad()
    def _init_weights(self, module):
        factor = self.config.initializer_factor
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=factor * (self.config.d_model ** -0.5))
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=factor * 1.0)

    def _run_encoder(self, hidden_states, attention_mask=None):
        batch_size, seq_len = hidden_states.shape[:2]
        attention_mask_2d, attention_mask_4d, _ = get_attention_mask(
            batch_size=batch_size, seq_len=seq_len, device=hidden_states.device, attention_mask=attention_mask,
        )
        position_bias = None
        for layer_module in self.block:
            hidden_states, _, position_bias = layer_module(
                hidden_states, attention_mask_2d=attention_mask_2d, attention_mask_4d=attention_mask_4d,
                position_bias=position_bias,
            )
        return self.final_layer_norm(hidden_states)

    def forward(self, input_ids, attention_mask=None):
        return self._run_encoder(self.embed_tokens(input_ids), attention_mask=attention_mask)


AA = "LAGVESIKRDTPNQFYMHCWXUBZO"


def tokenize(seqs):
    """ANKH-style: one token per residue, </s> (id 1) at the end, right padding with <pad> (id 0)."""
    ids = [[3 + AA.index(c) for c in s] + [1] for s in seqs]
    L = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [0] * (L - len(x)) for x in ids])
    return input_ids, (input_ids != 0).long()


def mean_pool(emb, attention_mask):
    m = attention_mask.unsqueeze(-1).float()
    return (emb * m).sum(1) / m.sum(1)


def main():
    torch.manual_seed(0)
    config = FastAnkhConfig(vocab_size=144, d_model=64, d_kv=16, d_ff=128, num_heads=4, num_layers=2,
                            relative_attention_num_buckets=32, relative_attention_max_distance=64)
    model = FAST_ANKH_ENCODER(config).eval()
    seqs = ["MKTAYIAKQRQISFVKSHFSRQ", "GSHMSLFDFFKNKGSAATATDRLKLILAKERTLNLPYMEEMRKEIIA", "MVLSEGEWQLVLHVWAKVEAD"]
    input_ids, attention_mask = tokenize(seqs)
    with torch.no_grad():
        emb = model(input_ids, attention_mask=attention_mask)
        pooled = mean_pool(emb, attention_mask)
        alone_ids, alone_mask = tokenize(seqs[:1])
        alone = mean_pool(model(alone_ids, attention_mask=alone_mask), alone_mask)
    print("fixed" if FIXED else "buggy",
          "pooled norm %.5f" % pooled.norm().item(),
          "seq0 batched-vs-alone max diff %.2e" % (pooled[0] - alone[0]).abs().max().item())


if __name__ == "__main__":
    main()
