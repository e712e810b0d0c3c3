"""optimum-intel IPEX causal LM: position_ids for a cached multi-token step cut down to the last column.

Citation: huggingface/optimum-intel#566 ("fix jit model"), optimum/intel/ipex/modeling_base.py,
``IPEXModelForCausalLM.forward``.

The wrapper around the (jit-traced) model builds ``position_ids`` itself when the caller passes none:
``attention_mask.long().cumsum(-1) - 1``, pads filled with 1, and, once there is a cache,

    position_ids = position_ids[:, -1].unsqueeze(-1)

which assumes one new token per cached step. Assisted (speculative) decoding verifies several draft
tokens in one cached forward, so all of them got the last token's position (the (B, 1) positions
broadcast over the new tokens without an error).

The fix (same PR): ``position_ids = position_ids[:, -input_ids.shape[-1]:]``, one position per new token.

Here: a tiny GPT-2 (learned absolute positions) from a config, wrapped the way the IPEX class wraps
its model, driven by an assisted-generation loop as transformers runs it (a smaller draft model
proposes 3 tokens, the target verifies them in one cached step, the cache is cropped to what was
accepted). Batch of one prompt, no padding.
"""

import sys
from typing import Optional

import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel
from transformers.modeling_outputs import CausalLMOutputWithPast

FIXED = "--fixed" in sys.argv


class IPEXModelForCausalLM:
    """Trimmed from optimum/intel/ipex/modeling_base.py: the forward that prepares the traced model's inputs."""

    def __init__(self, model, config, use_cache=True):
        self.model = model
        self.config = config
        self.use_cache = use_cache
        self.input_names = {"input_ids", "attention_mask", "position_ids", "past_key_values"}

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor = None,
        attention_mask: Optional[torch.FloatTensor] = None,
        past_key_values=None,
        position_ids: Optional[torch.FloatTensor] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        # 1. Prepare model inputs
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)

        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
        }

        if "position_ids" in self.input_names or not self.input_names:
            if position_ids is None:
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids.masked_fill_(attention_mask == 0, 1)
                if past_key_values:
                    if FIXED:
                        position_ids = position_ids[:, -input_ids.shape[-1] :]
                    else:
                        position_ids = position_ids[:, -1].unsqueeze(-1)
            inputs["position_ids"] = position_ids

        if self.use_cache:
            if past_key_values is None:
                past_key_values = DynamicCache(config=self.config)
            inputs["past_key_values"] = past_key_values

        # 2. Model forward
        outputs = self.model(**inputs, use_cache=self.use_cache)
        return CausalLMOutputWithPast(logits=outputs.logits, past_key_values=outputs.past_key_values)


def assisted_greedy(target, draft_model, input_ids, max_new_tokens, num_assistant_tokens=3):
    """Greedy assisted decoding (batch of one), following GenerationMixin._assisted_decoding."""
    attention_mask = torch.ones_like(input_ids)
    # prefill the target on the prompt minus its last token; the verify step feeds that token again
    out = target(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1])
    past = out.past_key_values
    accepted_counts = []
    while input_ids.shape[1] < prompt_len + max_new_tokens:
        cur_len = input_ids.shape[1]
        # draft: greedy candidates from the small model, no cache
        cand = input_ids
        for _ in range(num_assistant_tokens):
            nxt = draft_model(cand).logits[:, -1].argmax(-1, keepdim=True)
            cand = torch.cat([cand, nxt], dim=-1)
        candidate_new = cand[:, cur_len:]
        # verify: the last accepted token plus the candidates, in one cached step
        step_ids = cand[:, cur_len - 1 :]
        step_mask = torch.ones_like(cand)
        out = target(input_ids=step_ids, attention_mask=step_mask, past_key_values=past)
        past = out.past_key_values
        selected = out.logits.argmax(-1)  # (1, k + 1)
        n_matches = int(((~(candidate_new == selected[:, :-1])).cumsum(-1) < 1).sum())
        n_matches = min(n_matches, prompt_len + max_new_tokens - cur_len - 1)
        valid = selected[:, : n_matches + 1]
        input_ids = torch.cat([input_ids, valid], dim=-1)
        accepted_counts.append(n_matches)
        # keep in the cache only what precedes the new last token
        to_remove = past.get_seq_length() - (input_ids.shape[1] - 1)
        if to_remove > 0:
            past.crop(-to_remove)
    return input_ids, accepted_counts


torch.manual_seed(0)
vocab = 24
target_cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
draft_cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
target_cfg._attn_implementation = "eager"
target_model = GPT2LMHeadModel(target_cfg).eval()
draft = GPT2LMHeadModel(draft_cfg).eval()
# make the learned positions matter at toy size
with torch.no_grad():
    target_model.transformer.wpe.weight.mul_(8.0)

target = IPEXModelForCausalLM(target_model, target_cfg)
prompt = torch.tensor([[3, 17, 5, 9, 12, 1, 20, 7]])
prompt_len = prompt.shape[1]

with torch.no_grad():
    generated, accepted = assisted_greedy(target, draft, prompt, max_new_tokens=12)

print("generated:", generated[0, prompt_len:].tolist())
print("accepted per verify step:", accepted)
