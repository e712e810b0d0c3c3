# Search-R1 (PeterGriffinJin/Search-R1#21, commit 32719b5 "Fix bugs related to loss mask, meta info, and
# response length"; the same change was proposed as PR #20).
#
# Search-R1 trains a search agent with verl PPO/GRPO. The rollout interleaves model turns with retrieved
# "\n\n<information>...</information>\n\n" blocks inside the right-padded `responses`; the retrieved tokens must
# be left out of the policy loss (state masking). Before the fix, RayPPOTrainer._create_loss_mask rebuilt that
# mask after the rollout: it decoded each response to text, found the <information> markers with a regex and
# re-encoded the text prefix to turn character offsets into token offsets. A BPE merges across the boundary
# between the model's "</search>" and the observation's "\n\n" (">\n\n" is one token), so the re-encoded prefix
# is shorter than the real token prefix and the zeroed span lands one token early per earlier block: the
# policy loss trains on retrieved tokens and masks the model's own tokens.
# Fix: LLMGenerationManager builds `responses_with_info_mask` (observation ids replaced by pad) as it
# concatenates each turn, turns it into `info_mask` in _compose_final_output, and the loss mask (and the KL
# penalty's response mask) is read from `info_mask`.
import sys
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# --- a small stand-in for the Qwen2 BPE tokenizer (greedy longest match, merges across turn boundaries) -----
class TinyBPETokenizer:
    pad_token = "<|endoftext|>"

    def __init__(self):
        pieces = [self.pad_token, "<|im_start|>", "<|im_end|>", ">\n\n", "\n\n", "</", "<", ">", "search",
                  "information", "think", "answer", "Doc", " Paris", " France", " capital", " of", " is",
                  " the", " city", " river", " Seine", " Lyon", " Rhone", "Which", "What", " river", "?", ":",
                  " ", "1", "2", "(", ")", "."]
        pieces += [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
        self.vocab = {}
        for p in pieces:
            self.vocab.setdefault(p, len(self.vocab))
        self.inv = {i: p for p, i in self.vocab.items()}
        self.pad_token_id = self.vocab[self.pad_token]
        self.padding_side = "left"
        self._maxlen = max(len(p) for p in self.vocab)

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            for n in range(min(self._maxlen, len(text) - i), 0, -1):
                if text[i:i + n] in self.vocab:
                    ids.append(self.vocab[text[i:i + n]])
                    i += n
                    break
            else:
                raise ValueError(repr(text[i]))
        return ids

    def decode(self, ids, skip_special_tokens=False):
        ids = ids.tolist() if torch.is_tensor(ids) else ids
        out = []
        for i in ids:
            if skip_special_tokens and i == self.pad_token_id:
                continue
            out.append(self.inv[i])
        return "".join(out)

    def batch_decode(self, batch, skip_special_tokens=False):
        return [self.decode(x, skip_special_tokens) for x in batch]

    def __call__(self, texts, add_special_tokens=False, return_tensors="pt", padding="longest"):
        enc = [self.encode(t) for t in texts]
        n = max(len(e) for e in enc)
        rows = [e + [self.pad_token_id] * (n - len(e)) for e in enc]  # right padding, as for responses/obs
        return {"input_ids": torch.tensor(rows, dtype=torch.long)}


# --- search_r1/llm_agent/tensor_helper.py ---------------------------------------------------------------------
@dataclass
class TensorConfig:
    pad_token_id: int
    max_prompt_length: int
    max_obs_length: int
    max_start_length: int


class TensorHelper:
    def __init__(self, config: TensorConfig):
        self.config = config

    def convert_pad_structure(self, tensor: torch.Tensor, pad_to_left: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
        mask = tensor != self.config.pad_token_id if pad_to_left else tensor == self.config.pad_token_id
        sorted_indices = mask.to(torch.int64).argsort(dim=1, stable=True)
        return tensor.gather(1, sorted_indices), sorted_indices

    def create_attention_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.where(input_ids != self.config.pad_token_id, 1, 0)

    def create_position_ids(self, attention_mask: torch.Tensor) -> torch.Tensor:
        return (torch.cumsum(attention_mask, dim=1) - 1) * attention_mask

    def concatenate_with_padding(self, tensors: List[torch.Tensor], pad_to_left: bool = True) -> torch.Tensor:
        concatenated = torch.cat(tensors, dim=1)
        padded_tensor, _ = self.convert_pad_structure(concatenated, pad_to_left)
        return padded_tensor


# --- search_r1/llm_agent/generation.py (LLMGenerationManager, trimmed) ----------------------------------------
@dataclass
class GenerationConfig:
    max_turns: int
    max_start_length: int
    max_prompt_length: int
    max_response_length: int
    max_obs_length: int


class LLMGenerationManager:
    def __init__(self, tokenizer, config: GenerationConfig):
        self.tokenizer = tokenizer
        self.config = config
        self.tensor_fn = TensorHelper(TensorConfig(
            pad_token_id=tokenizer.pad_token_id,
            max_prompt_length=config.max_prompt_length,
            max_obs_length=config.max_obs_length,
            max_start_length=config.max_start_length,
        ))

    def _batch_tokenize(self, responses: List[str]) -> torch.Tensor:
        return self.tokenizer(responses, add_special_tokens=False, return_tensors='pt', padding="longest")['input_ids']

    def _process_next_obs(self, next_obs: List[str]) -> torch.Tensor:
        next_obs_ids = self.tokenizer(next_obs, padding='longest', return_tensors='pt',
                                      add_special_tokens=False)['input_ids']
        if next_obs_ids.shape[1] > self.config.max_obs_length:
            next_obs_ids = next_obs_ids[:, :self.config.max_obs_length]
        return next_obs_ids

    def _info_masked_concatenate_with_padding(self, prompt, prompt_with_mask, response, info=None, pad_to_left=True):
        pad_id = self.tokenizer.pad_token_id
        tensors = [prompt, response]
        tensors_with_mask = [prompt_with_mask, response]
        if info is not None:
            tensors.append(info)
            info_mask = torch.full(info.size(), pad_id, dtype=info.dtype, device=info.device)  # information mask
            tensors_with_mask.append(info_mask)
        concatenated = torch.cat(tensors, dim=1)
        concatenated_with_info = torch.cat(tensors_with_mask, dim=1)
        mask = concatenated != pad_id if pad_to_left else concatenated == pad_id
        sorted_indices = mask.to(torch.int64).argsort(dim=1, stable=True)
        padded_tensor = concatenated.gather(1, sorted_indices)
        padded_tensor_with_info = concatenated_with_info.gather(1, sorted_indices)
        return padded_tensor, padded_tensor_with_info

    def _update_right_side(self, right_side: Dict, cur_responses: torch.Tensor, next_obs_ids: torch.Tensor = None) -> Dict:
        if FIXED:
            if next_obs_ids is not None:
                responses, responses_with_info_mask = self._info_masked_concatenate_with_padding(
                    right_side['responses'], right_side['responses_with_info_mask'], cur_responses, next_obs_ids,
                    pad_to_left=False)
            else:
                responses, responses_with_info_mask = self._info_masked_concatenate_with_padding(
                    right_side['responses'], right_side['responses_with_info_mask'], cur_responses,
                    pad_to_left=False)
            effective_len = self.tensor_fn.create_attention_mask(responses).sum(dim=1).max()
            max_len = min(self.config.max_prompt_length, effective_len)
            return {'responses': responses[:, :max_len], 'responses_with_info_mask': responses_with_info_mask[:, :max_len]}
        if next_obs_ids is not None:
            responses = self.tensor_fn.concatenate_with_padding([
                right_side['responses'], cur_responses, next_obs_ids], pad_to_left=False)
        else:
            responses = self.tensor_fn.concatenate_with_padding([
                right_side['responses'], cur_responses], pad_to_left=False)
        effective_len = self.tensor_fn.create_attention_mask(responses).sum(dim=1).max()
        max_len = min(self.config.max_prompt_length, effective_len)
        return {'responses': responses[:, :max_len]}

    def run_llm_loop(self, initial_input_ids: torch.Tensor, turns: List[List[str]], observations: List[List[str]]):
        """The rollout with the generations replaced by scripted turns (the vLLM call is not ported)."""
        original_left_side = {'input_ids': initial_input_ids[:, -self.config.max_start_length:]}
        original_right_side = {'responses': initial_input_ids[:, []]}
        if FIXED:
            original_right_side['responses_with_info_mask'] = initial_input_ids[:, []]
        for step in range(self.config.max_turns):
            responses_ids = self._batch_tokenize(turns[step])
            next_obs = observations[step]
            if next_obs is not None:
                next_obs_ids = self._process_next_obs(next_obs)
                original_right_side = self._update_right_side(original_right_side, responses_ids, next_obs_ids)
            else:
                original_right_side = self._update_right_side(original_right_side, responses_ids)
        return self._compose_final_output(original_left_side, original_right_side)

    def _compose_final_output(self, left_side: Dict, right_side: Dict) -> Dict:
        final_output = right_side.copy()
        final_output['prompts'] = left_side['input_ids']
        final_output['input_ids'] = torch.cat([left_side['input_ids'], right_side['responses']], dim=1)
        final_output['attention_mask'] = torch.cat([
            self.tensor_fn.create_attention_mask(left_side['input_ids']),
            self.tensor_fn.create_attention_mask(final_output['responses'])
        ], dim=1)
        if FIXED:
            final_output['info_mask'] = torch.cat([
                self.tensor_fn.create_attention_mask(left_side['input_ids']),
                self.tensor_fn.create_attention_mask(final_output['responses_with_info_mask'])
            ], dim=1)
        final_output['position_ids'] = self.tensor_fn.create_position_ids(final_output['attention_mask'])
        return final_output


# --- verl/trainer/ppo/ray_trainer.py RayPPOTrainer._create_loss_mask ------------------------------------------
def _create_loss_mask(batch, tokenizer, start_marker="<information>", end_marker="</information>"):
    import re
    response_length = batch['responses'].shape[-1]
    response_mask = batch['attention_mask'][:, -response_length:]
    if FIXED:
        loss_mask = batch['info_mask'][:, -response_length:]
        batch['loss_mask'] = loss_mask
        return batch, {'state_tokens/total': loss_mask.sum().item()}

    state_mask = torch.ones_like(response_mask)
    responses = [tokenizer.decode(resp, skip_special_tokens=False) for resp in batch['responses']]
    for i, response in enumerate(responses):
        start_positions = [m.start() for m in re.finditer(re.escape(start_marker), response)]
        end_positions = [m.start() + len(end_marker) for m in re.finditer(re.escape(end_marker), response)]
        for start, end in zip(start_positions, end_positions):
            prefix_to_start = response[:start]
            state_section = response[start:end]
            start_tokens = tokenizer.encode(prefix_to_start, add_special_tokens=False)
            state_tokens = tokenizer.encode(state_section, add_special_tokens=False)
            start_token_pos = len(start_tokens)
            end_token_pos = start_token_pos + len(state_tokens)
            state_mask[i, start_token_pos:end_token_pos] = 0
    loss_mask = state_mask * response_mask
    batch['loss_mask'] = loss_mask
    return batch, {'state_tokens/total': loss_mask.sum().item()}


# --- verl pieces used by the actor update ---------------------------------------------------------------------
def masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis)


def compute_policy_loss(old_log_prob, log_prob, advantages, eos_mask, cliprange):
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, eos_mask)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), eos_mask)
    return pg_loss, ppo_kl


def logprobs_from_logits(logits, labels):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def forward_micro_batch(model, data, temperature=1.0):
    response_length = data['responses'].size(-1)
    logits = model(input_ids=data['input_ids'], attention_mask=data['attention_mask'],
                   position_ids=data['position_ids'], use_cache=False).logits
    logits = logits / temperature
    logits = logits[:, -response_length - 1:-1]
    return logprobs_from_logits(logits, data['responses'])


def main():
    tok = TinyBPETokenizer()
    cfg = Qwen2Config(vocab_size=len(tok.vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, attn_implementation="eager")
    actor = Qwen2ForCausalLM(cfg).eval()
    torch.manual_seed(1)
    old_actor = Qwen2ForCausalLM(cfg).eval()

    prompts = ["<|im_start|>What is the capital of France?<|im_end|>",
               "<|im_start|>Which river is in Lyon?<|im_end|>"]
    enc = [tok.encode(p) for p in prompts]
    n = max(len(e) for e in enc)
    initial_input_ids = torch.tensor([[tok.pad_token_id] * (n - len(e)) + e for e in enc])  # left-padded prompts

    turns = [
        ["<think>find it</think><search> capital of France</search>",
         "<think>look</think><search> Lyon river</search>"],
        ["<think>ok</think><search> Paris city</search>",
         "<answer> Rhone</answer>"],
        ["<answer> Paris</answer>", ""],
    ]
    observations = [
        ["\n\n<information>Doc 1: Paris is the capital of France.</information>\n\n",
         "\n\n<information>Doc 1: Lyon is on the river Rhone.</information>\n\n"],
        ["\n\n<information>Doc 2: Paris is on the river Seine.</information>\n\n", ""],
        None,
    ]
    gen = LLMGenerationManager(tok, GenerationConfig(max_turns=3, max_start_length=64, max_prompt_length=256,
                                                     max_response_length=128, max_obs_length=64))
    batch = gen.run_llm_loop(initial_input_ids, turns, observations)
    batch, metrics = _create_loss_mask(batch, tok)

    with torch.no_grad():
        old_log_prob = forward_micro_batch(old_actor, batch)
        log_prob = forward_micro_batch(actor, batch)
    scores = torch.tensor([1.0, -1.0])
    response_mask = batch['loss_mask']
    advantages = scores[:, None] * response_mask  # outcome reward broadcast over the response (GRPO, group of 2)
    pg_loss, ppo_kl = compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange=0.2)
    entropy_like = masked_mean(-log_prob, response_mask)

    print("responses shape", tuple(batch['responses'].shape))
    print("state_tokens/total", metrics['state_tokens/total'])
    print("loss_mask row0", batch['loss_mask'][0].tolist())
    print(f"pg_loss {pg_loss.item():.6f}  ppo_kl {ppo_kl.item():.6f}  nll {entropy_like.item():.6f}")


if __name__ == "__main__":
    main()
