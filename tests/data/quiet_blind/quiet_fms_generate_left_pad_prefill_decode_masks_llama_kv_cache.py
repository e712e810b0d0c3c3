# Citation: foundation-model-stack/foundation-model-stack @1f9513df71af80f3192d15c961742ad201226e5c
#   fms/utils/generation.py (__create_prefill_mask, __create_decode_mask, __create_prefill_position_ids, generate),
#   fms/modules/attention.py (MultiHeadAttention.forward, UnfusedQKV), fms/modules/positions.py
#   (RotaryEmbedding.compute_freqs_cis / adjusted_qk, PositionEncoder.adjusted_mask), fms/models/llama.py
#   (LLaMABlock.forward, LLaMA._helper / forward). Trimmed: no tensor parallel, no NTK scaling, no dropout, the
#   WordEmbedding is an nn.Embedding plus a separate head, GatedLinearUnit without multiple_of rounding.
# fms's generate() takes a list of differently sized prompts, left-pads them with F.pad (pad id 0) and builds
# position_ids that are 0 over the padding and 0..len-1 over each prompt. The prefill mask is a bool
# b x L x L: `is_pad.unsqueeze(-1) == is_pad.unsqueeze(-2)` (the name is_pad holds 1 for real tokens), tril'd,
# so real tokens see real earlier tokens only and pads see earlier pads. Each decode step grows every context
# length by one and passes `is_not_pad.unsqueeze(-2)` (b x 1 x ctx, zeros over the left padding) next to the
# KV cache the model concatenates onto. MultiHeadAttention unsqueezes the mask to 4-d and gives it to
# F.scaled_dot_product_attention as a bool attn_mask (True = attend), RoPE rotates by the position_ids.
# Self-check: each prompt runs alone (one row, no padding, mask=None so SDPA gets is_causal=True, no cache, the
# whole prefix recomputed every step): the greedy tokens and the logits behind every generated token match.
import math
from typing import Any, Callable, List, MutableMapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

torch.manual_seed(0)


# ---------------------------------------------------------------- fms/modules/positions.py
class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, ratio: float = 10_000.0, max_seq_len=2048):
        super().__init__()
        self.dim = dim
        self.ratio = ratio
        self.cached_freqs: MutableMapping[Any, MutableMapping[int, torch.Tensor]] = {}
        self.max_seq_len_cached: MutableMapping[Any, int] = {}
        self.max_seq_len = max_seq_len

    def compute_freqs_cis(self, device, max_seq_len=2048):
        alpha = 1
        dev_idx = device.index
        if dev_idx not in self.cached_freqs:
            self.cached_freqs[dev_idx] = {}
        if dev_idx not in self.max_seq_len_cached:
            self.max_seq_len_cached[dev_idx] = 0
        if self.max_seq_len_cached[dev_idx] > 0:
            return alpha
        max_seq_len = max(max_seq_len, self.max_seq_len)
        dim = self.dim
        freqs = 1.0 / (
            self.ratio ** (torch.arange(0, dim, 2, device=device)[: (dim // 2)].float() / dim)
        )
        t = torch.arange(max_seq_len, device=device, dtype=freqs.dtype)
        freqs = torch.outer(t, freqs).float()
        self.max_seq_len_cached[dev_idx] = max_seq_len
        self.cached_freqs[dev_idx][alpha] = torch.stack(
            [torch.cos(freqs), -torch.sin(freqs), torch.sin(freqs), torch.cos(freqs)],
            dim=2,
        ).view(*freqs.size(), 2, 2)
        return alpha

    def adjusted_mask(self, mask, q, k, past_kv_state, use_cache=False):
        return mask

    def adjusted_qk(self, q, k, position_ids=None, past_kv_state=None, use_cache=False):
        assert len(q.size()) == 4
        assert len(k.size()) == 4
        seq_len = max(k.size(1), q.size(1))
        if position_ids is None:
            position_ids = torch.arange(0, seq_len, dtype=torch.long, device=q.device).repeat(k.size(0), 1)
            if use_cache and past_kv_state is not None and past_kv_state[0].numel() > 0:
                position_ids += past_kv_state[0].size(2)

        q_ = q.float().view(*q.size()[:-1], -1, 2)  # B L H D/2 2
        k_ = k.float().view(*k.size()[:-1], -1, 2)  # B L H D/2 2

        max_start_pos = torch.max(position_ids[:, 0])
        alpha = self.compute_freqs_cis(q.device, max_start_pos + seq_len)
        freqs = self.cached_freqs[q.device.index][alpha][position_ids]

        freqs = freqs.float()  # 1 L D/2 2 2
        q_out = (freqs[:, -q.size(1):, None, :, :, :].mul(q_.unsqueeze(-2)).sum(5).flatten(3)).type_as(q)
        k_out = (freqs[:, -k.size(1):, None, :, :, :].mul(k_.unsqueeze(-2)).sum(5).flatten(3)).type_as(k)
        return q_out.view_as(q), k_out.view_as(k)


# ---------------------------------------------------------------- fms/modules/attention.py
class UnfusedQKV(nn.Module):
    def __init__(self, emb_dim, nheads, kvheads, emb_kq_per_head, emb_v_per_head, use_bias):
        super().__init__()
        self.query = nn.Linear(emb_dim, nheads * emb_kq_per_head, bias=use_bias)
        self.key = nn.Linear(emb_dim, kvheads * emb_kq_per_head, bias=use_bias)
        self.value = nn.Linear(emb_dim, kvheads * emb_v_per_head, bias=use_bias)

    def forward(self, q, k, v):
        if k is None and v is None:
            k = q
            v = q
        return self.query(q), self.key(k), self.value(v)


class MultiHeadAttention(nn.Module):
    def __init__(self, emb_dim, emb_kq, emb_v, nheads, kvheads, p_dropout=None, use_bias=False,
                 position_encoder=None):
        super().__init__()
        self.nheads = nheads
        self.kvheads = kvheads
        self.emb_dim = emb_dim
        self.emb_kq_per_head = emb_kq
        self.emb_v_per_head = emb_v
        self.p_dropout = p_dropout if p_dropout is not None else 0.0
        self.in_proj = UnfusedQKV(emb_dim, nheads, kvheads, emb_kq, emb_v, use_bias)
        self.dense = nn.Linear(self.nheads * self.emb_v_per_head, self.emb_dim, bias=use_bias)
        self.position_encoder = position_encoder

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                mask: Optional[Tensor] = None, position_ids=None, attn_algorithm=None,
                past_key_value_state: Optional[Tuple[Tensor, Tensor]] = None, use_cache=False,
                is_self=True, is_causal_mask=False):
        # q, k, v: batch_size x seq_len x emb_dim
        # mask: batch_size x seq_len x seq_len
        batch_size, q_len, _ = q.size()

        if is_self or past_key_value_state is None:
            q_out, k_out, v_out = self.in_proj(q, k, v)
            queries = q_out.view(batch_size, q_len, self.nheads, self.emb_kq_per_head)
            keys = k_out.view(batch_size, q_len, self.kvheads, self.emb_kq_per_head)
            values = v_out.view(batch_size, q_len, self.kvheads, self.emb_v_per_head)
            # You want to apply rotary embeddings pre-cache
            if self.position_encoder is not None:
                queries, keys = self.position_encoder.adjusted_qk(
                    queries, keys, position_ids, past_key_value_state, use_cache
                )

        queries = queries.transpose(2, 1)
        keys = keys.transpose(2, 1)
        values = values.transpose(2, 1)

        if use_cache and past_key_value_state is not None and past_key_value_state[0].numel() > 0:
            if is_self:
                keys = torch.cat((past_key_value_state[0], keys), dim=2)
                values = torch.cat((past_key_value_state[1], values), dim=2)
            else:
                keys = past_key_value_state[0]
                values = past_key_value_state[1]

        if mask is not None:
            # Our expected mask format is bs x q_len x k_len, so to make it broadcastable
            # we need to create the nheads dimension
            while len(mask.size()) != 4:  # expects bs (x nheads) x q_len x kv_len
                mask = mask.unsqueeze(1)

        if self.position_encoder is not None:
            attn_mask: Optional[Tensor] = self.position_encoder.adjusted_mask(
                mask, queries, keys, past_key_value_state, use_cache
            )
        else:
            attn_mask = mask

        # Expand kv so black-box attn will work
        expansion = self.nheads // self.kvheads
        if expansion != 1:
            keys_e = keys.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
            values_e = values.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
        else:
            keys_e = keys
            values_e = values

        attn = F.scaled_dot_product_attention(
            queries,
            keys_e,
            values_e,
            attn_mask=attn_mask,
            dropout_p=self.p_dropout if self.training else 0.0,
            is_causal=is_causal_mask,
        )

        attn = attn.transpose(2, 1).contiguous().view(batch_size, q_len, self.nheads * self.emb_v_per_head)
        out = self.dense(attn)
        if use_cache:
            return out, (keys, values)
        else:
            return out


# ---------------------------------------------------------------- fms/modules/layernorm.py, feedforward.py
class LayerNormParameterized(nn.Module):
    """use_mean=False, elementwise_shift=False: an RMSNorm."""

    def __init__(self, normalized_shape, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(normalized_shape))

    def forward(self, x):
        xf = x.float()
        x = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).type_as(xf)


class GatedLinearUnit(nn.Module):
    def __init__(self, emb_dim, hidden_grow_factor=8 / 3, use_bias=False):
        super().__init__()
        self.hidden_dim = int(hidden_grow_factor * emb_dim)
        self.wg = nn.Linear(emb_dim, self.hidden_dim, bias=use_bias)
        self.w1 = nn.Linear(emb_dim, self.hidden_dim, bias=use_bias)
        self.w2 = nn.Linear(self.hidden_dim, emb_dim, bias=use_bias)
        self.a = nn.SiLU()

    def forward(self, x):
        return self.w2(self.a(self.wg(x)) * self.w1(x))


# ---------------------------------------------------------------- fms/models/llama.py
class LLaMAConfig:
    def __init__(self, src_vocab_size=64, emb_dim=32, norm_eps=1e-5, nheads=4, kvheads=2, nlayers=2,
                 hidden_grow_factor=8 / 3, max_expected_seq_len=64, attn_bias=False, mlp_bias=False):
        self.src_vocab_size = src_vocab_size
        self.emb_dim = emb_dim
        self.norm_eps = norm_eps
        self.nheads = nheads
        self.kvheads = kvheads
        self.nlayers = nlayers
        self.hidden_grow_factor = hidden_grow_factor
        self.max_expected_seq_len = max_expected_seq_len
        self.attn_bias = attn_bias
        self.mlp_bias = mlp_bias
        self.p_dropout = 0.0


class LLaMABlock(nn.Module):
    def __init__(self, config: LLaMAConfig, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.config = config
        emb_kq = config.emb_dim // config.nheads
        emb_v = config.emb_dim // config.nheads
        self.ln = LayerNormParameterized(config.emb_dim, eps=config.norm_eps)
        self.ff_ln = LayerNormParameterized(config.emb_dim, eps=config.norm_eps)
        kvheads = config.nheads if config.kvheads == 0 else config.kvheads
        self.attn = MultiHeadAttention(config.emb_dim, emb_kq, emb_v, config.nheads, kvheads,
                                       p_dropout=config.p_dropout, use_bias=config.attn_bias,
                                       position_encoder=rotary_emb)
        self.ff_sub_layer = GatedLinearUnit(config.emb_dim, hidden_grow_factor=config.hidden_grow_factor,
                                            use_bias=config.mlp_bias)

    def forward(self, x, *, mask=None, position_ids=None, past_key_value_state=None, use_cache=False,
                is_causal_mask=False, attn_algorithm=None):
        self_attn_past_key_value = past_key_value_state
        residual = x
        x = self.ln(x)
        x = self.attn(q=x, mask=mask, position_ids=position_ids, attn_algorithm=attn_algorithm,
                      past_key_value_state=self_attn_past_key_value, use_cache=use_cache, is_self=True,
                      is_causal_mask=is_causal_mask)
        cache = None
        if use_cache:
            x, cache = x
        x = x + residual
        residual = x
        x = self.ff_ln(x)
        x = self.ff_sub_layer(x)
        x = x + residual
        if use_cache:
            return (x, cache)
        else:
            return x


class LLaMA(nn.Module):
    def __init__(self, config: LLaMAConfig):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.src_vocab_size, config.emb_dim)
        self.head = nn.Linear(config.emb_dim, config.src_vocab_size, bias=False)
        self.rot_emb = RotaryEmbedding(dim=config.emb_dim // config.nheads,
                                       max_seq_len=config.max_expected_seq_len)
        self.layers = nn.ModuleList([LLaMABlock(config, self.rot_emb) for _ in range(config.nlayers)])
        self.dec_norm = LayerNormParameterized(config.emb_dim, eps=config.norm_eps)

    def _helper(self, x_in, mask=None, position_ids=None, past_key_value_states=None, use_cache=False,
                attn_algorithm=None):
        if past_key_value_states is None or len(past_key_value_states) == 0:
            past_key_value_states = [None for _ in range(len(self.layers))]

        qlen = x_in.size(1)
        klen = x_in.size(1)
        if use_cache and past_key_value_states[0] is not None:
            klen += past_key_value_states[0][0].size(-2)

        # if mask is none, we need to specify causal mask
        if mask is None:
            # we are caching and can assume all 1s in the mask
            if use_cache and klen != 1 and qlen == 1:
                is_causal_mask = False
            else:
                is_causal_mask = True
        else:
            is_causal_mask = False

        x_in = self.shared(x_in)
        present_key_value_states = []
        for i, layer in enumerate(self.layers):
            output = layer(x=x_in, mask=mask, position_ids=position_ids,
                           past_key_value_state=past_key_value_states[i], use_cache=use_cache,
                           is_causal_mask=is_causal_mask, attn_algorithm=attn_algorithm)
            if use_cache:
                x_in, present_key_value_state = output
                present_key_value_states.append(present_key_value_state)
            else:
                x_in = output
        dec_out = self.dec_norm(x_in)
        return dec_out, present_key_value_states

    def forward(self, x, mask=None, position_ids=None, past_key_value_states=None, use_cache=False,
                only_last_token=False, attn_algorithm=None):
        output, cache = self._helper(x, mask, position_ids, past_key_value_states, use_cache, attn_algorithm)
        if only_last_token:
            output = output[:, -1, :]
        preds = self.head(output)
        if use_cache:
            return preds, cache
        else:
            return preds


# ---------------------------------------------------------------- fms/utils/generation.py
def __create_prefill_mask(prompt_lengths: List[int], device: Union[str, torch.device]) -> torch.Tensor:
    max_tokens = max(prompt_lengths)

    is_pad_list = []
    for seq_len in prompt_lengths:
        pads = torch.zeros(max_tokens - seq_len, dtype=torch.bool, device=device)
        non_pads = torch.ones(seq_len, dtype=torch.bool, device=device)
        is_pad_list.append(torch.cat((pads, non_pads)))
    is_pad = torch.stack(is_pad_list)
    mask = is_pad.unsqueeze(-1) == is_pad.unsqueeze(-2)
    return mask.tril()


def __create_decode_mask(context_lengths: List[int], device: Union[str, torch.device]) -> torch.Tensor:
    max_context_length = max(context_lengths)

    is_not_pad_list = []
    for seq_len in context_lengths:
        ones = torch.ones(seq_len, dtype=torch.bool, device=device)
        zeroes = torch.zeros(max_context_length - seq_len, dtype=torch.bool, device=device)
        is_not_pad_list.append(torch.cat((zeroes, ones)))
    is_not_pad = torch.stack(is_not_pad_list)
    mask = is_not_pad.unsqueeze(-2)
    return mask


def __create_prefill_position_ids(prompt_lengths: List[int], device: Union[str, torch.device]) -> torch.Tensor:
    max_len = max(prompt_lengths)
    position_ids = []
    for prompt_length in prompt_lengths:
        position_ids_i = [0] * (max_len - prompt_length) + [i for i in range(prompt_length)]
        position_ids.append(position_ids_i)
    return torch.tensor(position_ids, device=device, dtype=torch.long)


def generate(
    model: Union[Callable, torch.nn.Module],
    input_ids: Union[torch.Tensor, List[torch.Tensor]],
    max_seq_len: int = 4096,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_k: int = 10,
    do_sample: bool = True,
    num_beams: int = 1,
    use_cache: bool = False,
    eos_token_id: Optional[int] = None,
):
    if num_beams != 1:
        raise NotImplementedError("generate() does yet not support beam search")

    if isinstance(input_ids, torch.Tensor):
        is_batch = len(input_ids.shape) > 1
        if not is_batch:
            input_ids = input_ids.unsqueeze(0)
        max_len = input_ids.size(1)
        model_input_lengths = [max_len for _ in range(input_ids.size(0))]
        position_ids = None
    elif isinstance(input_ids, List):
        is_batch = len(input_ids) > 1
        max_len = max([seq.size(0) for seq in input_ids])
        model_input_lengths = [seq.size(0) for seq in input_ids]
        input_ids = torch.stack(
            [F.pad(input_ids[i], (max_len - model_input_lengths[i], 0)) for i in range(len(input_ids))]
        )
        position_ids = __create_prefill_position_ids(model_input_lengths, input_ids.device)
    else:
        raise TypeError("input_ids must be one of Tensor or List")

    eos_found = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    result = input_ids
    next_input = input_ids
    kwargs: MutableMapping[str, Any] = dict()
    kwargs["past_key_value_states"] = None
    kwargs["use_cache"] = use_cache
    kwargs["position_ids"] = position_ids

    for i in range(max_new_tokens):
        input_ids = next_input[:, -max_seq_len:]

        # prefill
        if i == 0:
            kwargs["mask"] = __create_prefill_mask(model_input_lengths, input_ids.device)
        # decode
        else:
            # add 1 for generate
            model_input_lengths = [model_input_lengths + 1 for model_input_lengths in model_input_lengths]
            kwargs["mask"] = __create_decode_mask(model_input_lengths, input_ids.device)
            if kwargs["position_ids"] is not None:
                if use_cache:
                    kwargs["position_ids"] = kwargs["position_ids"][:, -1:] + 1
                else:
                    kwargs["position_ids"] = torch.cat(
                        (kwargs["position_ids"], kwargs["position_ids"][:, -1:] + 1), dim=1
                    )

        output = model(input_ids, **kwargs)
        if use_cache:
            logits, past_key_value_states = output
            kwargs["past_key_value_states"] = past_key_value_states
        else:
            logits = output
        logits = logits[:, -1, :]

        if do_sample:
            logits = logits / temperature
            if top_k:
                v, _ = torch.topk(logits, top_k)
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            next_val = torch.multinomial(probs, num_samples=1)
        else:
            next_val = torch.argmax(logits, dim=-1).unsqueeze(0).t()

        result = torch.cat((result, next_val), dim=-1)

        if eos_token_id is not None:
            eos_found = torch.logical_or(eos_found, next_val == eos_token_id)
            if torch.sum(eos_found) == input_ids.shape[0]:
                break

        if use_cache:
            next_input = next_val
        else:
            next_input = result

    if not is_batch:
        result = result[0]
    return result


# ---------------------------------------------------------------- run + self-check
def main():
    config = LLaMAConfig()
    model = LLaMA(config).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.3) if p.dim() > 1 else nn.init.normal_(p, mean=1.0, std=0.1)

    lengths = [7, 3, 11, 5]
    prompts = [torch.randint(1, config.src_vocab_size, (n,)) for n in lengths]
    max_new_tokens = 6

    step_logits = []

    def recording_model(x, **kwargs):
        out = model(x, **kwargs)
        step_logits.append(out[0][:, -1, :].detach().clone())
        return out

    with torch.no_grad():
        result = generate(recording_model, prompts, max_seq_len=64, max_new_tokens=max_new_tokens,
                          do_sample=False, use_cache=True)

    max_len = max(lengths)
    assert result.shape == (len(prompts), max_len + max_new_tokens)
    worst = 0.0
    with torch.no_grad():
        for b, prompt in enumerate(prompts):
            # the batch row holds left padding, then the prompt, then the new tokens
            assert torch.equal(result[b, max_len - lengths[b]:max_len], prompt)
            seq = prompt.clone()
            for t in range(max_new_tokens):
                ref_logits = model(seq[None])[0, -1]  # alone, unpadded, is_causal, no cache
                worst = max(worst, (ref_logits - step_logits[t][b]).abs().max().item())
                nxt = ref_logits.argmax()
                assert nxt.item() == result[b, max_len + t].item(), (b, t)
                seq = torch.cat([seq, nxt[None]])
    assert worst < 1e-4, worst
    print(f"fms generate: {len(prompts)} left-padded prompts, {max_new_tokens} cached greedy steps; "
          f"max |logit diff| vs unpadded per-sequence runs = {worst:.2e}")


if __name__ == "__main__":
    main()
