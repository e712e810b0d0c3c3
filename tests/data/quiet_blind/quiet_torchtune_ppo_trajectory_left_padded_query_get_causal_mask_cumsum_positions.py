# Citation: pytorch/torchtune recipes/ppo_full_finetune_single_device.py @010eab0db449a7a147314eecc5e66633b7cf05ed
#   (PPOFullFinetuneRecipeSingleDevice.generate_trajectory, _ppo_step), torchtune/rlhf/_generation.py
#   @5971f3847d23369b4fea9559ad2b3a230d46c666 (generate_with_logits, generate_next_token_with_logits, sample,
#   get_causal_mask), torchtune/rlhf/sequence_processing.py @3ca4f49909c932d670977d9a0d3857d53b477e4b
#   (truncate_sequence_at_first_stop_token, logits_to_logprobs, truncate_sequence_for_logprobs),
#   torchtune/training get_unmasked_sequence_lengths; the model side (TransformerDecoder, MultiHeadAttention with
#   RoPE at input_pos and a bool mask to SDPA) written in plain torch the way torchtune/modules writes it.
# Correct program (quiet batch quiet-r132a): PPO trajectory generation over a batch of LEFT-padded queries
# (pad_id 0). The policy samples a fixed number of response tokens by re-running the whole (query, response)
# sequence each step with a [b, s, s] bool mask from get_causal_mask(~(tokens == pad_id)) (tril & pad rows/cols
# cleared, diagonal set) and input_pos = cumsum - 1 over the real tokens. The same mask and position ids then
# serve the reference policy, the value model and the reward model (on the response truncated after its first
# stop token and refilled with pad_id), and the first PPO step's policy / value forwards. Every log-prob, value
# and score is checked against each (query, response) run alone, unpadded, with no mask (plain causal).
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


# ---------------------------------------------------------------- torchtune/modules (trimmed)
class RotaryPositionalEmbeddings(nn.Module):
    def __init__(self, dim, max_seq_len=4096, base=10_000):
        super().__init__()
        theta = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        seq_idx = torch.arange(max_seq_len, dtype=theta.dtype)
        idx_theta = torch.einsum("i, j -> ij", seq_idx, theta).float()
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x, *, input_pos=None):
        # x: [b, s, n_h, h_d]; input_pos: None, [s] or [b, s]
        seq_len = x.size(1)
        rope_cache = self.cache[:seq_len] if input_pos is None else self.cache[input_pos]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack(
            [
                xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
            ],
            -1,
        )
        return x_out.flatten(3).type_as(x)


class MultiHeadAttention(nn.Module):
    def __init__(self, *, embed_dim, num_heads, num_kv_heads, head_dim, pos_embeddings, is_causal=True):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.is_causal = is_causal
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.output_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=False)
        self.pos_embeddings = pos_embeddings
        self.kv_cache = None

    def forward(self, x, y, *, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        s_y = y.shape[1]
        q_per_kv = self.num_heads // self.num_kv_heads
        q = self.q_proj(x).view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim)
        q = self.pos_embeddings(q, input_pos=input_pos).transpose(1, 2)
        k = self.k_proj(y).view(b, s_y, -1, self.head_dim)
        v = self.v_proj(y).view(b, s_y, -1, self.head_dim)
        k = self.pos_embeddings(k, input_pos=input_pos).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.num_heads != self.num_kv_heads:
            expand_shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)
        # attention_utils._sdpa_or_flex_attention, SDPA branch: [b, s, s] bool -> [b, 1, s, s]
        if mask is not None:
            mask = mask[:, None, :, :]
        output = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0,
            is_causal=self.kv_cache is None and mask is None and self.is_causal,
        )
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(output)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_fp32 = x.float()
        x_normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return x_normed * self.scale


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerSelfAttentionLayer(nn.Module):
    def __init__(self, attn, mlp, sa_norm, mlp_norm):
        super().__init__()
        self.attn = attn
        self.mlp = mlp
        self.sa_norm = sa_norm
        self.mlp_norm = mlp_norm

    def forward(self, x, *, mask=None, input_pos=None):
        h = self.sa_norm(x)
        h = self.attn(h, h, mask=mask, input_pos=input_pos) + x
        return h + self.mlp(self.mlp_norm(h))


class TransformerDecoder(nn.Module):
    def __init__(self, *, tok_embeddings, layers, norm, output):
        super().__init__()
        self.tok_embeddings = tok_embeddings
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.output = output

    def forward(self, tokens, *, mask=None, input_pos=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, mask=mask, input_pos=input_pos)
        h = self.norm(h)
        return self.output(h).float()


def llama_tiny(vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64,
               out_dim=None):
    """llama2 component builder, tiny; out_dim=1 is the classifier / value-head variant (llama2_classifier)."""
    head_dim = embed_dim // num_heads
    rope = RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len)
    layers = [
        TransformerSelfAttentionLayer(
            attn=MultiHeadAttention(embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                    head_dim=head_dim, pos_embeddings=rope),
            mlp=FeedForward(embed_dim, 4 * embed_dim),
            sa_norm=RMSNorm(embed_dim),
            mlp_norm=RMSNorm(embed_dim),
        )
        for _ in range(num_layers)
    ]
    return TransformerDecoder(
        tok_embeddings=nn.Embedding(vocab_size, embed_dim),
        layers=layers,
        norm=RMSNorm(embed_dim),
        output=nn.Linear(embed_dim, out_dim or vocab_size, bias=False),
    )


# ---------------------------------------------------------------- torchtune/rlhf/_generation.py
def multinomial_sample_one(probs, rng=None):
    q = torch.empty_like(probs).exponential_(1, generator=rng)
    return torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.int)


def sample(logits, temperature=1.0, top_k=None, rng=None):
    logits = logits / max(temperature, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return multinomial_sample_one(probs, rng)


def generate_next_token_with_logits(model, input_pos, x, *, mask=None, temperature=1.0, top_k=None, rng=None):
    logits = model(x, input_pos=input_pos, mask=mask)
    return logits, sample(logits[:, -1].clone(), temperature, top_k, rng)


def get_causal_mask(padding_mask):
    """[bsz, seq_len] bool (True = real token) -> [bsz, seq_len, seq_len] bool causal mask for SDPA."""
    _, seq_len = padding_mask.shape
    mask = torch.tril(torch.ones(seq_len, seq_len, device=padding_mask.device, dtype=bool), diagonal=0)
    mask = mask & (padding_mask[:, None, :] & padding_mask[:, :, None])
    mask.diagonal(dim1=1, dim2=2)[:] = True
    return mask


@torch.inference_mode()
def generate_with_logits(model, prompt, *, max_generated_tokens, pad_id=0, temperature=1.0, top_k=None, rng=None):
    prompt = prompt.view(1, -1) if prompt.ndim == 1 else prompt
    _, prompt_length = prompt.size()
    generated_tokens = prompt.clone()
    for i in range(max_generated_tokens):
        padding_masks = generated_tokens == pad_id
        if padding_masks.any():
            mask = get_causal_mask(~padding_masks)
            input_pos = (~padding_masks).cumsum(-1) - (~padding_masks).long()
            input_pos = input_pos.to(torch.int)
        else:
            mask = None
            input_pos = torch.arange(0, prompt_length + i, device=generated_tokens.device)
        logits, tokens = generate_next_token_with_logits(
            model, input_pos=input_pos, x=generated_tokens, mask=mask,
            temperature=temperature, top_k=top_k, rng=rng,
        )
        generated_tokens = torch.cat([generated_tokens, tokens], dim=-1)
    return generated_tokens, logits


# ---------------------------------------------------------------- torchtune/rlhf/sequence_processing.py
def truncate_sequence_at_first_stop_token(sequences, stop_tokens, fill_value=0):
    eos_mask = torch.isin(sequences, stop_tokens)
    seq_lens = torch.cumsum(eos_mask, dim=1)
    padding_mask = (seq_lens > 1) | ((seq_lens == 1) & ~eos_mask)
    sequences[padding_mask] = fill_value
    return padding_mask, sequences


def logits_to_logprobs(logits, sequences, temperature=1.0):
    return torch.gather(F.log_softmax(logits / temperature, dim=-1), 2, sequences.unsqueeze(-1)).squeeze(-1)


def truncate_sequence_for_logprobs(query_response_logits, context_length):
    return query_response_logits[:, context_length - 1 : -1]


# ---------------------------------------------------------------- torchtune/training
def get_unmasked_sequence_lengths(mask):
    sequence_lengths = (~mask).cumsum(dim=-1).argmax(dim=-1).to(dtype=torch.long)
    return sequence_lengths.clip(0, mask.shape[1] - 1)


# ---------------------------------------------------------------- recipes/ppo_full_finetune_single_device.py
class Trajectory(NamedTuple):
    query_responses: torch.Tensor
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    masks: torch.Tensor
    position_ids: torch.Tensor
    response_padding_masks: torch.Tensor
    value_padding_masks: torch.Tensor
    value_seq_idxs: torch.Tensor
    scores: torch.Tensor
    seq_lens: torch.Tensor


class PPORecipe:
    def __init__(self, policy, ref_policy, value_model, reward_model, *, pad_id, stop_token_ids,
                 max_generated_tokens, temperature, top_k, seed):
        self._policy_model = policy
        self._ref_policy_model = ref_policy
        self._value_model = value_model
        self._reward_model = reward_model
        self._pad_id = pad_id
        self._stop_token_ids = stop_token_ids
        self._max_generated_tokens = max_generated_tokens
        self._temperature = temperature
        self._top_k = top_k
        self._rng = torch.Generator().manual_seed(seed)

    def generate_trajectory(self, input_ids):
        batch_size, context_length = input_ids.shape

        # step 1: generate responses, and logits corresponding to the responses using the current policy
        query_responses, logits = generate_with_logits(
            model=self._policy_model,
            prompt=input_ids,
            max_generated_tokens=self._max_generated_tokens,
            temperature=self._temperature,
            top_k=self._top_k,
            pad_id=self._pad_id,
            rng=self._rng,
        )
        responses = query_responses[:, context_length:].clone()
        query_response_padding_masks = query_responses == self._pad_id

        # step 1.1 attention masks and position IDs for the padding tokens, used for later forward passes
        masks = get_causal_mask(~(query_response_padding_masks))
        position_ids = (~query_response_padding_masks).cumsum(-1) - (~query_response_padding_masks).long()
        position_ids = position_ids.type(torch.int)
        del query_response_padding_masks

        # step 2. logprobs of the responses under the current policy
        logits = logits[:, context_length - 1 :]
        logprobs = logits_to_logprobs(logits, responses, self._temperature)

        # step 2.1 logprobs under the reference policy
        ref_logits = self._ref_policy_model(query_responses, input_pos=position_ids, mask=masks)
        ref_logits = truncate_sequence_for_logprobs(ref_logits, context_length)
        ref_logprobs = logits_to_logprobs(ref_logits, responses, self._temperature)

        # step 3. values
        values = self._value_model(query_responses, input_pos=position_ids, mask=masks)
        values = truncate_sequence_for_logprobs(values, context_length).squeeze(-1)

        # step 4. truncate after the first stop token, refill with pad_id
        response_padding_masks, responses = truncate_sequence_at_first_stop_token(
            responses, self._stop_token_ids, self._pad_id
        )

        # step 5. reward model on (query, truncated response)
        scores = self._reward_model(torch.cat([input_ids, responses], dim=1), input_pos=position_ids, mask=masks)

        # step 5.1 the score is the logit at the last non-padding response token
        seq_lens = get_unmasked_sequence_lengths(response_padding_masks)
        scores = scores[torch.arange(batch_size), seq_lens + context_length].squeeze(-1)

        # step 6. mask out invalid values
        logprobs[response_padding_masks] = 1.0
        ref_logprobs[response_padding_masks] = 1.0

        # step 6.1 values are masked out *after* the last valid token in the response
        value_seq_idxs = torch.where(
            (seq_lens > 0) & (seq_lens < self._max_generated_tokens - 1), seq_lens + 1, seq_lens,
        )
        value_padding_masks = response_padding_masks.clone()
        value_padding_masks[torch.arange(batch_size), value_seq_idxs] = False
        values[value_padding_masks] = 0.0

        return Trajectory(
            query_responses=query_responses, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values,
            masks=masks, position_ids=position_ids, response_padding_masks=response_padding_masks,
            value_padding_masks=value_padding_masks, value_seq_idxs=value_seq_idxs, scores=scores,
            seq_lens=seq_lens,
        )

    def ppo_step_forward(self, trajectory, context_length):
        """The two model calls at the top of _ppo_step."""
        pi_logits = self._policy_model(
            trajectory.query_responses, input_pos=trajectory.position_ids, mask=trajectory.masks
        )
        pi_logits = truncate_sequence_for_logprobs(pi_logits, context_length)
        pi_logprobs = logits_to_logprobs(
            pi_logits, trajectory.query_responses[:, context_length:], self._temperature
        )
        pi_logprobs[trajectory.response_padding_masks] = 1.0

        phi_values = self._value_model(
            trajectory.query_responses, input_pos=trajectory.position_ids, mask=trajectory.masks
        )
        phi_values = truncate_sequence_for_logprobs(phi_values, context_length).squeeze(-1)
        phi_values[trajectory.value_padding_masks] = 0.0
        return pi_logprobs, phi_values


# ---------------------------------------------------------------- run
PAD_ID = 0  # plays the tokenizer's <unk>/pad slot
STOP_TOKEN_IDS = torch.tensor([2, 3])
VOCAB = 128
MAX_GEN = 7
TEMPERATURE = 0.7

policy = llama_tiny(vocab_size=VOCAB)
ref_policy = llama_tiny(vocab_size=VOCAB)
ref_policy.load_state_dict(policy.state_dict())
with torch.no_grad():  # the reference drifts a little from the policy, as after some PPO steps
    for p in ref_policy.parameters():
        p.add_(0.02 * torch.randn_like(p))
value_model = llama_tiny(vocab_size=VOCAB, out_dim=1)
reward_model = llama_tiny(vocab_size=VOCAB, out_dim=1)
for m in (policy, ref_policy, value_model, reward_model):
    m.eval()

# left-padded queries, as the PPO dataset's collator pads them (padding_idx = pad_id, left side)
queries = [
    [17, 44, 9, 81, 23, 60],
    [12, 99, 5],
    [70, 33, 48, 15],
    [101],
]
context_length = max(len(q) for q in queries)
input_ids = torch.tensor([[PAD_ID] * (context_length - len(q)) + q for q in queries])

recipe = PPORecipe(policy, ref_policy, value_model, reward_model, pad_id=PAD_ID, stop_token_ids=STOP_TOKEN_IDS,
                   max_generated_tokens=MAX_GEN, temperature=TEMPERATURE, top_k=None, seed=6)
with torch.no_grad():
    traj = recipe.generate_trajectory(input_ids)
    pi_logprobs, phi_values = recipe.ppo_step_forward(traj, context_length)

responses_full = traj.query_responses[:, context_length:]
# this batch: no sampled token hit pad_id, and two responses stop early (the others run to MAX_GEN)
assert not (responses_full == PAD_ID).any()
assert (traj.seq_lens < MAX_GEN - 1).sum() == 2


# ---------------------------------------------------------------- reference: each (query, response) alone
@torch.no_grad()
def alone(model, tokens):
    return model(torch.tensor(tokens)[None])[0]  # no mask, no input_pos: plain causal, positions 0..n-1


max_err = 0.0
for i, q in enumerate(queries):
    r = responses_full[i].tolist()
    n = len(q)
    real = ~traj.response_padding_masks[i]
    L = int(traj.seq_lens[i])
    assert real[: L + 1].all() and not real[L + 1 :].any()

    want_lp = logits_to_logprobs(alone(policy, q + r)[None, n - 1 : -1], torch.tensor(r)[None], TEMPERATURE)[0]
    want_ref = logits_to_logprobs(alone(ref_policy, q + r)[None, n - 1 : -1], torch.tensor(r)[None], TEMPERATURE)[0]
    want_val = alone(value_model, q + r)[n - 1 : -1, 0]
    want_score = alone(reward_model, q + r[: L + 1])[-1, 0]

    for got, want in ((traj.logprobs[i], want_lp), (traj.ref_logprobs[i], want_ref), (pi_logprobs[i], want_lp)):
        max_err = max(max_err, (got[real] - want[real]).abs().max().item())
        assert torch.equal(got[~real], torch.ones_like(got[~real]))
    value_real = ~traj.value_padding_masks[i]
    for got in (traj.values[i], phi_values[i]):
        max_err = max(max_err, (got[value_real] - want_val[value_real]).abs().max().item())
        assert (got[~value_real] == 0).all()
    max_err = max(max_err, (traj.scores[i] - want_score).abs().item())

print(f"responses: {responses_full.tolist()}")
print(f"last real response index: {traj.seq_lens.tolist()}")
print(f"max |batched - alone| over logprobs, ref_logprobs, values, scores, ppo-step logprobs/values: {max_err:.2e}")
assert max_err < 1e-5
print("ok")
