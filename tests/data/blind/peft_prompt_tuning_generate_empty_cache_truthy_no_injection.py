# Citation: huggingface/peft#2106 "FIX: Change check if past_key_values is empty", commit c29810bad
#           (reported as huggingface/peft#2123: "PeftModelForCausalLM.generate ignores prompt tuning
#           parameters unless use_cache=False").
# Upstream: src/peft/peft_model.py, PeftModelForCausalLM.prepare_inputs_for_generation (prompt tuning).
# Bug: generate() now creates its cache object before the first step, and after transformers#33703 an empty
#      Cache that already holds its per-layer slots is truthy. PEFT decided whether this is the first step
#      with `not model_kwargs["past_key_values"]`, so the soft prompt was never injected, while the
#      num_virtual_tokens ones were still prepended to attention_mask: every step's mask is longer than
#      the keys by num_virtual_tokens, and the padding columns are read shifted onto other tokens.
# Fix: test the cache's contents instead: `not model_kwargs["past_key_values"].get_seq_length()`.
# (Here the installed transformers' DynamicCache(config=...) is the truthy empty cache.)
import sys
import warnings

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Cache

FIXED = "--fixed" in sys.argv
warnings.filterwarnings("ignore", category=FutureWarning)

PROMPT_TUNING = "PROMPT_TUNING"
PREFIX_TUNING = "PREFIX_TUNING"


class PromptTuningConfig:
    def __init__(self, num_virtual_tokens, token_dim, num_transformer_submodules=1):
        self.peft_type = PROMPT_TUNING
        self.task_type = "CAUSAL_LM"
        self.num_virtual_tokens = num_virtual_tokens
        self.token_dim = token_dim
        self.num_transformer_submodules = num_transformer_submodules
        self.is_prompt_learning = True


class PromptEmbedding(nn.Module):
    # src/peft/tuners/prompt_tuning/model.py (RANDOM init)
    def __init__(self, config, word_embeddings):
        super().__init__()
        total_virtual_tokens = config.num_virtual_tokens * config.num_transformer_submodules
        self.embedding = nn.Embedding(total_virtual_tokens, config.token_dim)

    def forward(self, indices):
        return self.embedding(indices)


class PeftModelForCausalLM(nn.Module):
    def __init__(self, model, peft_config):
        super().__init__()
        self.base_model = model
        self.peft_config = peft_config
        self.active_peft_config = peft_config
        self.word_embeddings = model.get_input_embeddings()
        self.prompt_encoder = PromptEmbedding(peft_config, self.word_embeddings)
        self.prompt_tokens = torch.arange(peft_config.num_virtual_tokens * peft_config.num_transformer_submodules).long()
        self.base_model_prepare_inputs_for_generation = llama_prepare_inputs_for_generation

    def get_prompt(self, batch_size, task_ids=None):
        peft_config = self.active_peft_config
        prompt_tokens = self.prompt_tokens.unsqueeze(0).expand(batch_size, -1)
        prompt_tokens = prompt_tokens[:, : peft_config.num_virtual_tokens]
        prompts = self.prompt_encoder(prompt_tokens)
        return prompts

    def prepare_inputs_for_generation(self, *args, task_ids=None, **kwargs):
        peft_config = self.active_peft_config
        model_kwargs = self.base_model_prepare_inputs_for_generation(*args, **kwargs)
        uses_cache = True  # transformers >= 4.38

        if peft_config.is_prompt_learning:
            if uses_cache and (model_kwargs["past_key_values"] is not None):
                # In prompt learning methods, past key values are longer when compared to the `input_ids`.
                # As such only consider the last input ids in the autogressive generation phase.
                past_key_values = model_kwargs["past_key_values"]
                if isinstance(past_key_values, (tuple, list)):
                    seq_len = past_key_values[0][0].shape[-2]
                else:  # using transformers kv cache
                    seq_len = past_key_values.get_seq_length()
                if seq_len >= model_kwargs["input_ids"].shape[1]:
                    model_kwargs["input_ids"] = model_kwargs["input_ids"][:, -1:]

            if model_kwargs.get("attention_mask", None) is not None:
                size = model_kwargs["input_ids"].shape[0], peft_config.num_virtual_tokens
                prefix_attention_mask = torch.ones(size).to(model_kwargs["input_ids"].device)
                model_kwargs["attention_mask"] = torch.cat(
                    (prefix_attention_mask, model_kwargs["attention_mask"]), dim=1
                )

            if model_kwargs.get("position_ids", None) is not None:
                model_kwargs["position_ids"] = None

            # no past_key_values or past_key_values empty cache
            if FIXED:
                requires_prompt_injection = (model_kwargs["past_key_values"] is None) or (
                    isinstance(model_kwargs["past_key_values"], Cache)
                    and not model_kwargs["past_key_values"].get_seq_length()
                )
            else:
                requires_prompt_injection = (model_kwargs["past_key_values"] is None) or (
                    isinstance(model_kwargs["past_key_values"], Cache) and not model_kwargs["past_key_values"]
                )

            if requires_prompt_injection and peft_config.peft_type == PREFIX_TUNING:
                raise NotImplementedError
            elif requires_prompt_injection:
                inputs_embeds = self.word_embeddings(model_kwargs["input_ids"])
                prompts = self.get_prompt(batch_size=model_kwargs["input_ids"].shape[0], task_ids=task_ids)
                prompts = prompts.to(inputs_embeds.dtype)
                model_kwargs["inputs_embeds"] = torch.cat((prompts, inputs_embeds), dim=1)
                model_kwargs["input_ids"] = None

        # `cache_position` is properly created by the model, using the passed `inputs_embeds`
        _ = model_kwargs.pop("cache_position", None)
        return model_kwargs

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, max_new_tokens):
        # transformers GenerationMixin.generate -> _sample, greedy, trimmed
        model = self.base_model
        past_key_values = DynamicCache(config=model.config)  # _prepare_cache_for_generation
        cache_position = torch.arange(input_ids.shape[1])  # _get_initial_cache_position
        for _ in range(max_new_tokens):
            model_inputs = self.prepare_inputs_for_generation(
                input_ids,
                past_key_values=past_key_values,
                attention_mask=attention_mask,
                cache_position=cache_position,
                use_cache=True,
            )
            outputs = model(**model_inputs, return_dict=True)
            next_token_logits = outputs.logits[:, -1, :]
            next_tokens = torch.argmax(next_token_logits, dim=-1)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            # _update_model_kwargs_for_generation
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
            cache_position = cache_position[-1:] + 1
        return input_ids


def llama_prepare_inputs_for_generation(
    input_ids, past_key_values=None, attention_mask=None, inputs_embeds=None, cache_position=None,
    position_ids=None, use_cache=True, **kwargs
):
    # LlamaForCausalLM.prepare_inputs_for_generation (transformers 4.45), trimmed
    if past_key_values is not None:
        if inputs_embeds is not None:
            input_ids = input_ids[:, -cache_position.shape[0]:]
        elif input_ids.shape[1] != cache_position.shape[0]:
            input_ids = input_ids[:, cache_position]

    if attention_mask is not None and position_ids is None:
        # create position_ids on the fly for batch generation
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        if past_key_values:
            position_ids = position_ids[:, -input_ids.shape[1]:]
            position_ids = position_ids.clone(memory_format=torch.contiguous_format)

    if inputs_embeds is not None and cache_position[0] == 0:
        model_inputs = {"inputs_embeds": inputs_embeds, "input_ids": None}
    else:
        model_inputs = {"input_ids": input_ids.clone(memory_format=torch.contiguous_format), "inputs_embeds": None}

    model_inputs.update(
        {
            "position_ids": position_ids,
            "cache_position": cache_position,
            "past_key_values": past_key_values,
            "use_cache": use_cache,
            "attention_mask": attention_mask,
        }
    )
    return model_inputs


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config._attn_implementation = "sdpa"
    base = LlamaForCausalLM(config).eval()
    peft_config = PromptTuningConfig(num_virtual_tokens=4, token_dim=config.hidden_size)
    model = PeftModelForCausalLM(base, peft_config).eval()
    with torch.no_grad():
        model.prompt_encoder.embedding.weight.normal_(0.0, 1.0)

    # tokenizer.padding_side = "left" for batched generation
    input_ids = torch.tensor(
        [
            [1, 17, 43, 8, 29, 61, 12, 5],
            [0, 0, 0, 1, 33, 70, 14, 9],
        ]
    )
    attention_mask = (input_ids != config.pad_token_id).long()

    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6)
    print("generated:", out[:, input_ids.shape[1]:].tolist())


if __name__ == "__main__":
    main()
