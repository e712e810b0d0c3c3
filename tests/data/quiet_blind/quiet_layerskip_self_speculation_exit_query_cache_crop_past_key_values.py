# Correct program (quiet batch quiet-r139b).
# Ported from facebookresearch/LayerSkip @f42c66965545747d42e27d4beab86b5c17956566:
#   self_speculation/self_speculation_generator.py (SelfSpeculativeGenerationStrategy.generate_token_ids and
#   single_step_speculation, greedy branch: the first exit_layer layers draft, the remaining layers verify the
#   drafts in one pass, crop_past_key_values rolls every layer back to prompt + accepted tokens),
#   self_speculation/llama_model_utils.py (forward_early, forward_remainder with its early / full attention masks
#   and the exit_query_cache, _prepare_decoder_attention_mask / _make_causal_mask / _expand_mask,
#   decode_next_token, crop_past_key_values), self_speculation/generator_base.py (GenerationConfig).
# The draft model is the target's first exit_layer layers plus its norm and lm_head (self-speculation).
# Ported to transformers 5: the decoder layers take `cache=` and `position_embeddings` (rotary from
# model.model.rotary_emb at the same position_ids) and return the hidden states; the legacy tuple cache is
# converted as DynamicCache.from_legacy_cache / to_legacy_cache did. Streamer, logits processors, stopping
# criteria and the sampling branch are left out. Tiny random LlamaForCausalLM in float64.
# Self-check: the tokens equal plain greedy decoding of the full model (no cache, whole sequence each step),
# and after every step each layer's cropped cache equals the keys / values of a fresh full-model pass over
# prompt + accepted tokens.
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicCache

torch.manual_seed(0)
# float64 throughout (the mask helpers build their causal mask in the default dtype)
torch.set_default_dtype(torch.float64)


@dataclass
class GenerationStrategyResult:
    predicted_tokens: List[int]
    acceptance_rate: Optional[float] = None


@dataclass
class GenerationConfig:
    max_steps: int = 512
    exit_layer: int = -1
    num_speculations: int = -1
    generation_strategy: str = "autoregressive"
    sample: bool = True


@dataclass
class ForwardResult:
    logits: torch.Tensor
    past_key_values: Optional[List[Tuple[torch.Tensor, torch.Tensor]]]
    exit_query_cache: Optional[List[torch.Tensor]] = None


def from_legacy_cache(past_key_values) -> DynamicCache:
    cache = DynamicCache()
    if past_key_values is not None:
        for layer_idx, (key_states, value_states) in enumerate(past_key_values):
            cache.update(key_states, value_states, layer_idx)
    return cache


def to_legacy_cache(cache: DynamicCache):
    return tuple((layer.keys, layer.values) for layer in cache.layers if layer.is_initialized)


# Copied from transformers.models.bart.modeling_bart.BartDecoder._prepare_decoder_attention_mask
def _prepare_decoder_attention_mask(model, attention_mask, input_shape, inputs_embeds, past_key_values_length):
    # create causal mask
    # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
    combined_attention_mask = None
    if input_shape[-1] > 1:
        combined_attention_mask = _make_causal_mask(
            input_shape,
            inputs_embeds.dtype,
            device=inputs_embeds.device,
            past_key_values_length=past_key_values_length,
        )

    if attention_mask is not None:
        # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
        expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1]).to(
            inputs_embeds.device
        )
        combined_attention_mask = (
            expanded_attn_mask if combined_attention_mask is None else expanded_attn_mask + combined_attention_mask
        )

    return combined_attention_mask


# Copied from transformers.models.bart.modeling_bart._make_causal_mask
def _make_causal_mask(
    input_ids_shape: torch.Size, dtype: torch.dtype, device: torch.device, past_key_values_length: int = 0
):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)

    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


# Copied from transformers.models.bart.modeling_bart._expand_mask
def _expand_mask(mask: torch.Tensor, dtype: torch.dtype, tgt_len: Optional[int] = None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len

    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)

    inverted_mask = 1.0 - expanded_mask

    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


def decode_next_token(logits: torch.Tensor, token_idx: int = None, sample: Optional[bool] = False):
    if token_idx:
        logits = logits[:, -1, :]

    if not sample:
        next_token = logits.argmax(dim=-1)
        return next_token, None
    raise NotImplementedError("only greedy decoding is ported")


def crop_past_key_values(
    past_key_values: List[Tuple[torch.Tensor, torch.Tensor]],
    maximum_length: int,
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    new_past: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for idx in range(len(past_key_values)):
        if past_key_values[idx] is None or past_key_values[idx][0] is None:
            break
        new_past.append(
            (
                past_key_values[idx][0][:, :, :maximum_length, :],
                past_key_values[idx][1][:, :, :maximum_length, :],
            )
        )
    past_key_values = tuple(new_past)
    return past_key_values


def forward_early(
    model: transformers.LlamaForCausalLM,
    input_ids: torch.Tensor,
    past_key_values: Optional[List[Tuple[torch.Tensor, torch.Tensor]]],
    exit_layer: int,
    exit_query_cache: Optional[List[torch.Tensor]],
) -> ForwardResult:
    device = input_ids.device
    batch_size, seq_length = input_ids.shape

    seq_length_with_past = seq_length
    past_key_values_length = 0

    if past_key_values is not None:
        past_key_values_length = past_key_values[0][0].shape[2]
        seq_length_with_past = seq_length_with_past + past_key_values_length
    past_key_values = from_legacy_cache(past_key_values)

    position_ids = torch.arange(
        past_key_values_length,
        seq_length + past_key_values_length,
        dtype=torch.long,
        device=device,
    )
    position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
    attention_mask = input_ids.new_ones(
        (batch_size, seq_length_with_past),
        dtype=torch.bool,
    )
    inputs_embeds = model.model.embed_tokens(input_ids)
    attention_mask = _prepare_decoder_attention_mask(
        model,
        attention_mask,
        (batch_size, seq_length),
        inputs_embeds,
        past_key_values_length,
    )

    hidden_states = inputs_embeds
    position_embeddings = model.model.rotary_emb(hidden_states, position_ids)
    for decoder_layer in model.model.layers[:exit_layer]:
        hidden_states = decoder_layer(
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=past_key_values,
            use_cache=True,
            position_embeddings=position_embeddings,
        )

    past_key_values = to_legacy_cache(past_key_values)

    if exit_query_cache is None:
        exit_query_cache = hidden_states
    else:
        exit_query_cache = torch.cat([exit_query_cache, hidden_states], dim=1)

    hidden_states = model.model.norm(hidden_states)

    logits = model.lm_head(hidden_states)
    return ForwardResult(logits=logits, past_key_values=past_key_values, exit_query_cache=exit_query_cache)


def forward_remainder(
    model: transformers.LlamaForCausalLM,
    input_ids: torch.Tensor,
    past_key_values: Optional[List[Tuple[torch.Tensor, torch.Tensor]]],
    exit_layer: int,
    exit_query_cache: Optional[List[torch.Tensor]],
) -> ForwardResult:
    device = input_ids.device
    batch_size, seq_length = input_ids.shape
    num_tokens_to_generate: int = 1
    seq_length_with_past = seq_length
    draft_past_key_values_length: int = 0
    full_past_key_values_length: int = 0

    if past_key_values is not None and past_key_values[0] is not None:
        # it's okay to use the first layer because the draft model necessairly computes it
        draft_past_key_values_length = past_key_values[0][0].shape[2]
        # the last layer should not have been skipped, we can get this to check how many of the tokens have
        # gone through full verification
        if len(past_key_values) == len(model.model.layers):
            full_past_key_values_length = past_key_values[-1][0].shape[2]
        else:
            # we have not done a full pass yet so the history is 0
            full_past_key_values_length = 0

        seq_length_with_past = num_tokens_to_generate + draft_past_key_values_length
    past_key_values = from_legacy_cache(past_key_values)

    inputs_embeds = model.model.embed_tokens(input_ids)

    position_ids = torch.arange(
        full_past_key_values_length,
        seq_length_with_past,
        dtype=torch.long,
        device=device,
    )
    position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
    attention_mask = input_ids.new_ones(
        (batch_size, seq_length_with_past),
        dtype=torch.bool,
    )
    early_attention_mask = _prepare_decoder_attention_mask(
        model,
        attention_mask,
        (batch_size, num_tokens_to_generate),
        inputs_embeds,
        draft_past_key_values_length,
    )

    full_attention_mask = _prepare_decoder_attention_mask(
        model,
        attention_mask,
        (batch_size, seq_length),
        inputs_embeds,
        full_past_key_values_length,  # we have no past for the full model
    )

    hidden_states = inputs_embeds
    full_hidden_states: Optional[torch.FloatTensor] = None
    for idx, decoder_layer in enumerate(model.model.layers):
        is_early_exit = idx < exit_layer
        if is_early_exit:
            # early hidden states: B x num_gen x C
            early_hidden_states = hidden_states[:, -num_tokens_to_generate:]
            early_position_ids = position_ids[:, -num_tokens_to_generate:]
            hidden_states = decoder_layer(
                early_hidden_states,
                attention_mask=early_attention_mask,
                position_ids=early_position_ids,
                cache=past_key_values,
                use_cache=True,
                position_embeddings=model.model.rotary_emb(early_hidden_states, early_position_ids),
            )
        else:
            if full_hidden_states is None and exit_query_cache is not None:
                # first time seeing the full hidden states, we need to rely on the query cache
                # only use if exit query cache exists, if not this is our first call
                full_hidden_states = torch.cat(
                    [exit_query_cache, hidden_states[:, -num_tokens_to_generate:]],
                    dim=1,
                )
            else:
                # we already have seen the fully hidden states we can re-use them now
                full_hidden_states = hidden_states
            hidden_states = decoder_layer(
                full_hidden_states,
                attention_mask=full_attention_mask,
                position_ids=position_ids,
                cache=past_key_values,
                use_cache=True,
                position_embeddings=model.model.rotary_emb(full_hidden_states, position_ids),
            )

    past_key_values = to_legacy_cache(past_key_values)
    hidden_states = model.model.norm(hidden_states)
    logits = model.lm_head(hidden_states)

    return ForwardResult(logits=logits, past_key_values=past_key_values, exit_query_cache=exit_query_cache)


class SelfSpeculativeGenerationStrategy:
    def __init__(self, on_step=None):
        self.on_step = on_step

    def generate_token_ids(
        self,
        model: transformers.LlamaForCausalLM,
        input_ids: List[int],
        eos_token_ids: List[int],
        generation_config: GenerationConfig,
    ) -> GenerationStrategyResult:
        past_key_values = None

        input_ids_list = input_ids
        input_ids: torch.Tensor = torch.tensor([input_ids_list]).to(model.device)
        output_ids: List[int] = []

        calls: int = 0
        total_draft_matches = 0
        total_generations = 0
        while len(output_ids) < generation_config.max_steps:
            (
                input_ids,
                output_ids,
                past_key_values,
                number_of_matches,
                num_speculations,
            ) = self.single_step_speculation(
                model=model,
                input_ids_list=input_ids_list,
                input_ids=input_ids,
                output_ids=output_ids,
                num_speculations=min(
                    generation_config.num_speculations,
                    generation_config.max_steps - len(output_ids) - 1,
                ),
                past_key_values=past_key_values,
                exit_layer=generation_config.exit_layer,
                eos_token_ids=eos_token_ids,
                calls=calls,
                sample=generation_config.sample,
            )
            calls += 1
            total_draft_matches += number_of_matches
            total_generations += num_speculations
            if self.on_step is not None:
                self.on_step(input_ids_list, output_ids, past_key_values, number_of_matches, num_speculations)
            eos_found = False
            for eos_token_id in eos_token_ids:
                if eos_token_id in output_ids:
                    # break out of loop when we get an EOS token
                    # remove the EOS token id
                    output_ids = output_ids[: output_ids.index(eos_token_id)]
                    eos_found = True
                    break
            if eos_found:
                break
        return GenerationStrategyResult(
            predicted_tokens=output_ids,
            acceptance_rate=total_draft_matches / total_generations,
        )

    def single_step_speculation(
        self,
        model: transformers.LlamaForCausalLM,
        input_ids: torch.Tensor,
        input_ids_list: List[int],
        output_ids: List[int],
        num_speculations: int,
        past_key_values: Optional[List[Tuple[torch.Tensor, torch.Tensor]]],
        eos_token_ids: List[int],
        calls: int,
        exit_layer: int,
        sample: Optional[bool] = False,
    ):
        prompt_length: int = input_ids.size(1)
        draft_input_ids = input_ids.clone()
        draft_output_ids: List[int] = []
        exit_query_cache = None
        for _ in range(num_speculations):
            draft_result = forward_early(
                model,
                draft_input_ids,
                past_key_values,
                exit_layer,
                exit_query_cache,
            )
            past_key_values = draft_result.past_key_values
            exit_query_cache = draft_result.exit_query_cache
            draft_logits = draft_result.logits
            draft_next_token, draft_next_prob = decode_next_token(logits=draft_logits, token_idx=-1, sample=sample)
            draft_next_token = draft_next_token.item()
            draft_output_ids.append(draft_next_token)
            draft_input_ids = torch.tensor([[draft_next_token]]).to(draft_input_ids)
            if draft_next_token in eos_token_ids:
                # break out of loop when we get an EOS token
                break

        # input_ids (1 x T_p) and draft_output_ids (1 x T_d) are concatenated together to make
        # 1 x (T_d  + T_p)
        draft_output_ids = torch.tensor(draft_output_ids, dtype=torch.long).unsqueeze(0).to(input_ids)
        prefill_token_ids = torch.cat(
            [input_ids, draft_output_ids],
            dim=-1,
        )

        # logits: 1 x (T_d  + T_p) x V
        verify_results = forward_remainder(
            model,
            prefill_token_ids.int(),
            past_key_values,
            exit_layer,
            exit_query_cache,
        )
        logits = verify_results.logits
        past_key_values = verify_results.past_key_values
        # only select the logits relevant to what the draft has outputted.
        # verification_logits: 1 x T_d x V
        verification_logits = logits[:, prompt_length - 1 :, :]

        # verified_tokens: 1 x (T_d)
        verified_tokens, verified_probabilities = decode_next_token(logits=verification_logits, sample=sample)

        # skip verification of the last token as it is a new token predicted from the main model
        verified_tokens = verified_tokens.to(prefill_token_ids)
        verified = draft_output_ids[:, :] == verified_tokens[:, :-1]

        # number of matches is the index of the number of tokens we are accepting from the draft
        number_of_matches = ((~(verified)).cumsum(dim=-1) < 1).sum().item()

        # accept the `number_of_matches` tokens from the draft with one more from the main model
        # since we re-use the same cache the input id should only be the last accepted token
        input_ids = verified_tokens[:, number_of_matches : number_of_matches + 1]
        output_ids.extend(draft_output_ids[0, :number_of_matches].tolist())
        output_ids.extend(verified_tokens[0][number_of_matches : number_of_matches + 1].tolist())

        # we want the entire output sequence + input sequence
        past_key_values = crop_past_key_values(past_key_values, len(input_ids_list) + len(output_ids) - 1)

        return (
            input_ids,
            output_ids,
            past_key_values,
            number_of_matches,
            draft_output_ids.numel(),
        )


def build_model():
    config = LlamaConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    # Let the shallow layers carry most of the signal, as LayerSkip's early-exit training does, so the drafts
    # are often (not always) accepted.
    with torch.no_grad():
        for layer in model.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(0.2)
            layer.mlp.down_proj.weight.mul_(0.2)
    return model


@torch.no_grad()
def reference_greedy(model, prompt, max_steps, eos_token_ids):
    ids = list(prompt)
    out = []
    while len(out) < max_steps:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
        token = logits[0, -1].argmax().item()
        out.append(token)
        ids.append(token)
        if token in eos_token_ids:
            return out[: out.index(token)]
    return out


@torch.no_grad()
def main():
    model = build_model()
    exit_layer = 2
    eos_token_ids = [1]
    stats = {"steps": 0, "partial": 0, "full": 0, "worst_cache": 0.0}

    def check_cache(prompt, output_ids, past_key_values, number_of_matches, num_speculations):
        # the cache holds prompt + every accepted token but the last (which is the next step's input)
        seen = list(prompt) + output_ids[:-1]
        fresh = model(input_ids=torch.tensor([seen]), use_cache=True).cache
        assert len(past_key_values) == len(model.model.layers)
        for layer_idx, (key_states, value_states) in enumerate(past_key_values):
            ref = fresh.layers[layer_idx]
            assert key_states.shape == ref.keys.shape, (key_states.shape, ref.keys.shape)
            err = max((key_states - ref.keys).abs().max().item(), (value_states - ref.values).abs().max().item())
            stats["worst_cache"] = max(stats["worst_cache"], err)
            assert err < 1e-9, err
        stats["steps"] += 1
        if num_speculations:
            stats["full" if number_of_matches == num_speculations else "partial"] += 1

    strategy = SelfSpeculativeGenerationStrategy(on_step=check_cache)
    prompts = [[5, 9, 14, 3], [7, 22, 30, 11, 2, 40, 17], [12, 12, 19, 26, 8, 4]]
    for prompt in prompts:
        for num_speculations in (2, 4):
            config = GenerationConfig(
                max_steps=12, exit_layer=exit_layer, num_speculations=num_speculations, sample=False
            )
            result = strategy.generate_token_ids(model, prompt, eos_token_ids, config)
            expected = reference_greedy(model, prompt, config.max_steps, eos_token_ids)
            assert result.predicted_tokens == expected, (prompt, num_speculations, result.predicted_tokens, expected)
            print(
                f"prompt len {len(prompt)} k={num_speculations}: {len(expected)} tokens, "
                f"acceptance {result.acceptance_rate:.2f}"
            )
    assert stats["partial"] > 0 and stats["full"] > 0, stats
    print(
        f"ok: {stats['steps']} speculation steps ({stats['partial']} with a rejected draft, {stats['full']} fully "
        f"accepted); tokens equal plain greedy, cropped caches equal a fresh pass (max err {stats['worst_cache']:.1e})"
    )


if __name__ == "__main__":
    main()
