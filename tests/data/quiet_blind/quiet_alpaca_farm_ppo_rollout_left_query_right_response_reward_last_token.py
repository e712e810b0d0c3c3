"""AlpacaFarm PPO rollout: left-padded queries, sampled responses right-padded to response_len, policy / reference /
value passes over the concatenation, the reward model over a re-tokenized left-padded batch read at its last
position, and the KL-shaped reward (correct program).

Port, shrunk to toy sizes, of tatsu-lab/alpaca_farm @30717ddae735365de756ee2085191b491a71788d:
  src/alpaca_farm/data_preprocessor.py  QueryDataset: each prompt tokenized alone, torch_ops.left_pad to query_len
      with pad_token_id, query_attn_masks = queries.ne(pad_token_id)
  src/alpaca_farm/torch_ops.py  left_pad / right_pad / pad, compute_logprobs (cross_entropy, ignore_index = pad)
  src/alpaca_farm/models/rl_models.py
      AutoregressivePolicy._respond: base_model.generate(inputs=queries, attention_mask=query_attn_masks,
          do_sample=True, top_p=1.0, top_k=0, temperature), responses = right_pad(sequences[:, query_len:],
          response_len, pad_token_id)
      AutoregressivePolicy.forward: input_ids = cat(queries, responses); attention_mask = input_ids.ne(pad);
          attention_mask[:, :query_len] = query_attn_masks; prepare_inputs_for_generation(...); logits
          [:, -response_len - 1 : -1] / temperature; logprobs against input_ids[:, -response_len:]; entropies
      AutoregressiveValue.forward: sequence_attn_masks = sequences.ne(pad); base_model.model(...);
          last_hidden_state[:, query_len - 1 : -1] -> value_head
      ActorCritic.forward
  src/alpaca_farm/models/reward_model.py  RewardModel.forward: backbone_model.model(input_ids, attention_mask),
      reward_head(last_hidden_state[:, -1, :])
  src/alpaca_farm/rl/ppo_trainer.py  _make_left_padded_tokenizer (padding_side="left", "[PAD]" added when the
      tokenizer has none), PPOTrainer.rollout (respond, policy and ref_policy passes, batch_decode with
      skip_special_tokens, re-tokenize q + r with padding=True, reward_model(**sequences), post_reward),
      _shape_reward (terminal_positions = (responses != pad).sum(1) - 1)
  src/alpaca_farm/rl/kl_controller.py FixedKLController; common.make_generative_lm -> transformers.LlamaForCausalLM.

The policy and reward tokenizers pad on the left ("reward_tokenizer left pads, since we need the embedding of the
right most non-pad token"), so position -1 of every reward row is its last real token.  [PAD] is its own id, never
EOS: the sampled EOS keeps attention 1 and its log-prob, the response slots after it are pads with attention 0 and
log-prob 0 (ignore_index).  transformers 4.x's LlamaForCausalLM.prepare_inputs_for_generation derived position_ids
from the attention mask (cumsum - 1, pads set to 1); the installed transformers moved that into generate(), so the
same lines are kept next to the call.  The reward model gets no position ids, as upstream: Llama's rotary positions
only enter through differences, so a left-padded row shifted as a whole scores the same.

Left out: synced_gpus / accelerate / FSDP wrappers, the GAE and PPO loss (they run over all response_len slots as
upstream does, no mask involved), the value head's zero init (random here so the values are not all 0).

Self-check (reference): every query alone, unpadded, with its response cut at the first pad, no mask, default
positions: the response log-probs at temperature, entropies, values and reference log-probs token by token, zeros
in the pad slots; the reward of each decoded query + response re-tokenized alone (no padding) at its last token;
the shaped reward (KL penalty everywhere, score added at the last real response token) by a loop.
"""
import string
from types import SimpleNamespace
from typing import Dict, Optional, Sequence, Union

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from torch import Tensor, nn

torch.manual_seed(0)

DEFAULT_PAD_TOKEN = "[PAD]"


# ---------------------------------------------------------------- a character-level stand-in for the LLaMA tokenizer
def _make_left_padded_tokenizer() -> transformers.PreTrainedTokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in string.ascii_lowercase + " .,:\n#":
        vocab[c] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>", padding_side="left",
        model_max_length=96,
    )
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens(dict(pad_token=DEFAULT_PAD_TOKEN))
    return tokenizer


# ---------------------------------------------------------------- torch_ops.py
def compute_logprobs(logits: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
    """Compute per-token logprobs, zeroing out places with ignore_index (padding)."""
    return -F.cross_entropy(logits.permute(0, 2, 1), labels, reduction="none", ignore_index=ignore_index)


def pad(inputs: Tensor, target_size: Union[torch.Size, Sequence[int]], value=0.0, left=True):
    current_size = inputs.size()
    diffs = tuple(ti - ci for ti, ci in zip(target_size, current_size))
    pad_params = []
    for diff in diffs:
        pad_params = ([diff, 0] if left else [0, diff]) + pad_params
    res = F.pad(inputs, pad=pad_params, value=value)
    return res


def left_pad(inputs: Tensor, target_size: Union[torch.Size, Sequence[int]], value=0.0):
    return pad(inputs=inputs, target_size=target_size, value=value, left=True)


def right_pad(inputs: Tensor, target_size: Union[torch.Size, Sequence[int]], value=0.0):
    return pad(inputs=inputs, target_size=target_size, value=value, left=False)


def prepare_inputs_for_generation(base_model, input_ids, attention_mask, use_cache=False):
    inputs = base_model.prepare_inputs_for_generation(
        input_ids=input_ids,
        attention_mask=attention_mask,
        use_cache=use_cache,
    )
    if inputs.get("position_ids") is None:
        # transformers 4.x LlamaForCausalLM.prepare_inputs_for_generation
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        inputs["position_ids"] = position_ids
    return inputs


# ---------------------------------------------------------------- data_preprocessor.py
class QueryDataset(torch.utils.data.Dataset):
    """Dataset that emits tokenized left-padded queries."""

    def __init__(self, prompts, tokenizer, query_len: int):
        queries = [tokenizer(prompt, return_tensors="pt", truncation=False).input_ids[0] for prompt in prompts]
        filtered_queries = [query for query in queries if len(query) <= query_len]
        queries = torch.stack(
            [left_pad(query, target_size=(query_len,), value=tokenizer.pad_token_id) for query in filtered_queries]
        )
        self.queries = queries
        self.query_attn_masks = queries.ne(tokenizer.pad_token_id).long()
        self.prompts = prompts

    def __getitem__(self, i):
        return dict(queries=self.queries[i], query_attn_masks=self.query_attn_masks[i])

    def __len__(self):
        return len(self.queries)


# ---------------------------------------------------------------- models/rl_models.py
class AutoregressivePolicy(nn.Module):
    def __init__(self, args, base_model, base_tokenizer):
        super().__init__()
        self.args = args
        self.base_model = base_model
        self.base_tokenizer = base_tokenizer

    def respond(self, queries, query_attn_masks, temperature=None, num_return_sequences=1):
        assert not self.training, "Policy must be in eval model for generation."
        return self._respond(queries, query_attn_masks, temperature, num_return_sequences)

    def forward(self, queries: Tensor, query_attn_masks: Tensor, responses: Tensor, temperature: Optional[float] = None) -> Dict[str, Tensor]:
        # TODO(lxuechen): Refactor attention mask. Here query_attn_masks overrides padding-based attention mask.
        if temperature is None:
            temperature = self.args.temperature
        input_ids = torch.cat([queries, responses], dim=1)
        attention_mask = input_ids.ne(self.base_tokenizer.pad_token_id)
        attention_mask[:, : queries.size(1)] = query_attn_masks
        # Fix position id issues and ensure consistency with `respond` for GPT and OPT.
        inputs = prepare_inputs_for_generation(
            self.base_model,
            input_ids=input_ids,
            attention_mask=attention_mask,
            use_cache=False,
        )
        outputs = self.base_model(**inputs, output_hidden_states=True)
        original_logits = outputs.logits[:, -self.args.response_len - 1 : -1]
        logits = original_logits / temperature
        labels = input_ids[:, -self.args.response_len :]
        logprobs = compute_logprobs(logits, labels, ignore_index=self.base_tokenizer.pad_token_id)
        entropies = -(logits.softmax(dim=-1) * logits.log_softmax(dim=-1)).sum(dim=-1)
        last_hidden_state = outputs.hidden_states[-1][:, -self.args.response_len - 1 : -1]
        return dict(
            original_logits=original_logits,
            logits=logits,
            logprobs=logprobs,
            entropies=entropies,
            last_hidden_state=last_hidden_state,
        )

    def _respond(self, queries, query_attn_masks, temperature=None, num_return_sequences=1) -> Dict[str, Tensor]:
        if temperature is None:
            temperature = self.args.temperature
        sequences = self.base_model.generate(
            inputs=queries,
            attention_mask=query_attn_masks,
            do_sample=True,
            max_new_tokens=self.args.response_len,
            pad_token_id=self.base_tokenizer.pad_token_id,
            top_p=1.0,
            top_k=0,
            temperature=temperature,
            num_return_sequences=num_return_sequences,
        )
        responses = right_pad(
            sequences[:, queries.size(1) :],
            target_size=(sequences.size(0), self.args.response_len),
            value=self.base_tokenizer.pad_token_id,
        )
        return dict(responses=responses)  # Size (bsz * num_return_sequences, response_len).


class AutoregressiveValue(nn.Module):
    def __init__(self, args, base_model, base_tokenizer):
        super().__init__()
        self.args = args
        self.base_model = base_model
        self.base_tokenizer = base_tokenizer
        hidden_size = base_model.config.hidden_size
        self.value_head = torch.nn.Linear(hidden_size, 1)

    def forward(self, queries: Tensor, query_attn_masks: Tensor, responses: Tensor) -> Dict[str, Tensor]:
        sequences = torch.cat([queries, responses], dim=1)
        sequence_attn_masks = sequences.ne(self.base_tokenizer.pad_token_id)

        inputs = prepare_inputs_for_generation(
            self.base_model,
            input_ids=sequences,
            attention_mask=sequence_attn_masks,
            use_cache=False,
        )
        outputs = self.base_model.model(**inputs, return_dict=True)
        # value[t]: \hat{V}(sequences_{:t-1}); must align with `_estimate_advantage`.
        last_hidden_state = outputs.last_hidden_state[:, queries.size(1) - 1 : -1]
        values = self.value_head(last_hidden_state).squeeze(-1)
        return dict(values=values)


class ActorCritic(nn.Module):
    def __init__(self, policy, value_model):
        super(ActorCritic, self).__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, queries, query_attn_masks, responses, temperature=None) -> Dict[str, Tensor]:
        # Assume the policy and value model share the same tokenizer.
        o1 = self.policy(queries, query_attn_masks, responses, temperature)
        o2 = self.value_model(queries, query_attn_masks, responses)
        return {**o1, **o2}

    def respond(self, queries, query_attn_masks, temperature=None):
        return self.policy.respond(queries=queries, query_attn_masks=query_attn_masks, temperature=temperature)


# ---------------------------------------------------------------- models/reward_model.py
class RewardModel(nn.Module):
    def __init__(self, backbone_model):
        super(RewardModel, self).__init__()
        self.backbone_model = backbone_model
        hidden_size = backbone_model.config.hidden_size
        reward_head = nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(reward_head.bias)
        self.reward_head = reward_head

    def forward(self, input_ids, attention_mask=None, return_dict=True, **kwargs):
        outputs = self.backbone_model.model(
            input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **kwargs
        )
        last_hidden_state = outputs.last_hidden_state
        last_hidden_state_at_the_end = last_hidden_state[:, -1, :]
        rewards = self.reward_head(last_hidden_state_at_the_end).squeeze(-1)
        return dict(rewards=rewards)


# ---------------------------------------------------------------- rl/ppo_trainer.py
class FixedKLController:
    def __init__(self, kl_coef):
        self.value = kl_coef


class PPOTrainer:
    def __init__(self, args, policy, ref_policy, reward_model, tokenizer):
        self.args = args
        self.policy = policy
        self.ref_policy = ref_policy
        self.reward_model = reward_model
        self.tokenizer = tokenizer
        self.kl_ctl = FixedKLController(args.kl_coef)

    def _shape_reward(self, rewards: Tensor, responses: Tensor, logprobs: Tensor, ref_logprobs: Tensor) -> Dict[str, Tensor]:
        kl = torch.clamp(logprobs - ref_logprobs, min=0.0)
        non_score_rewards = -self.kl_ctl.value * kl
        shaped_rewards = non_score_rewards.clone()
        # This introduces a small index off by one bug if pad_token_id == eos_token_id.
        terminal_positions = (responses != self.tokenizer.pad_token_id).sum(dim=1) - 1
        shaped_rewards[list(range(rewards.size(0))), terminal_positions] += rewards
        return dict(shaped_rewards=shaped_rewards, non_score_rewards=non_score_rewards, kl=kl)

    def post_reward(self, reward_outputs: Dict[str, Tensor], responses: Tensor) -> Dict[str, Tensor]:
        """Assign bad reward values to sequences which didn't stop properly."""
        if self.args.truncate_token_ids is None:
            return reward_outputs
        raise NotImplementedError

    @torch.inference_mode()
    def rollout(self, queries_data) -> Dict[str, Tensor]:
        self.policy.eval()
        self.ref_policy.eval()
        self.reward_model.eval()

        rollouts = []
        for batch in queries_data:
            queries, query_attn_masks = batch["queries"], batch["query_attn_masks"]
            respond_outputs = self.policy.respond(queries, query_attn_masks, temperature=self.args.temperature)
            responses = respond_outputs["responses"]

            # Evaluate logprobs of the samples.
            rollouts_batch = {"queries": queries, "query_attn_masks": query_attn_masks, "responses": responses}
            policy_outputs = self.policy(**rollouts_batch, temperature=self.args.temperature)
            ref_policy_outputs = self.ref_policy(**rollouts_batch, temperature=self.args.temperature)
            policy_outputs = {k: policy_outputs[k] for k in ("logprobs", "values", "entropies")}
            ref_policy_outputs = {k: ref_policy_outputs[k] for k in ("logprobs", "entropies")}
            rollouts_batch.update(policy_outputs)
            rollouts_batch.update({f"ref_{key}": value for key, value in ref_policy_outputs.items()})

            # Evaluate reward of the samples.
            text_queries, text_responses = tuple(
                self.tokenizer.batch_decode(tensor, skip_special_tokens=True, clean_up_tokenization_spaces=True)
                for tensor in (queries, responses)
            )
            del queries, responses  # Prevent mistakes.

            # We retokenizer, since policy and reward model might not have the same tokenizer.
            text_sequences = [q + r for q, r in zip(text_queries, text_responses)]
            sequences, responses = tuple(
                self.tokenizer(text, return_tensors="pt", padding=True, truncation=True)
                for text in (text_sequences, text_responses)
            )

            reward_outputs = self.reward_model(**sequences)
            reward_outputs = self.post_reward(reward_outputs, responses.input_ids)
            rollouts_batch.update(reward_outputs)

            # Shape reward with KL penalty.
            shape_reward_outputs = self._shape_reward(
                rewards=rollouts_batch["rewards"],
                responses=rollouts_batch["responses"],
                logprobs=rollouts_batch["logprobs"],
                ref_logprobs=rollouts_batch["ref_logprobs"],
            )
            rollouts_batch.update(shape_reward_outputs)
            rollouts_batch["text_sequences"] = text_sequences
            rollouts.append(rollouts_batch)
        return rollouts


PROMPTS = [
    "### in:\nname a color.\n### out:\n",
    "### in:\nsay hi.\n### out:\n",
    "### in:\nwrite about the sea.\n### out:\n",
    "### in:\nadd one and one.\n### out:\n",
    "### in:\nlist three fruits, short.\n### out:\n",
    "### in:\ngo.\n### out:\n",
    "### in:\nwhat is a cat.\n### out:\n",
    "### in:\nspell dog backwards.\n### out:\n",
]


def main():
    tokenizer = _make_left_padded_tokenizer()
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    assert pad_id != eos_id
    args = SimpleNamespace(temperature=0.7, response_len=12, query_len=48, kl_coef=0.2, truncate_token_ids=None)

    cfg = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    cfg._attn_implementation = "sdpa"

    def make_generative_policy(seed):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(cfg).eval()
        model.generation_config.eos_token_id = eos_id
        # a trained policy never emits [PAD] (it was added after training); its untrained stand-in is told so here
        model.generation_config.suppress_tokens = [pad_id]
        return model

    torch.manual_seed(3)
    reward_model = RewardModel(transformers.LlamaForCausalLM(cfg)).eval()
    policy = AutoregressivePolicy(args, make_generative_policy(1), tokenizer)
    value_model = AutoregressiveValue(args, reward_model.backbone_model, tokenizer)  # init_value_with_reward
    actor_critic = ActorCritic(policy=policy, value_model=value_model).eval()
    ref_policy = AutoregressivePolicy(args, make_generative_policy(2), tokenizer).eval()
    trainer = PPOTrainer(args, actor_critic, ref_policy, reward_model, tokenizer)

    ds = QueryDataset(PROMPTS, tokenizer, query_len=args.query_len)
    assert len(ds) == len(PROMPTS)
    batch = {"queries": ds.queries, "query_attn_masks": ds.query_attn_masks}
    torch.manual_seed(17)
    (ro,) = trainer.rollout([batch])

    queries, qmask, responses = ro["queries"], ro["query_attn_masks"], ro["responses"]
    lens = []
    for i in range(queries.size(0)):
        r = responses[i].tolist()
        n = r.index(pad_id) if pad_id in r else len(r)
        assert all(t == pad_id for t in r[n:]) and pad_id not in r[:n]
        lens.append(n)
    print("query lengths", qmask.sum(-1).tolist(), "response lengths", lens)
    assert len(set(qmask.sum(-1).tolist())) > 3 and min(lens) < args.response_len and max(lens) == args.response_len

    # ------------------------------------------------------------ reference: every row alone, unpadded, no mask
    T = args.temperature
    tol = dict(atol=1e-4, rtol=1e-4)
    for i in range(queries.size(0)):
        q = queries[i][qmask[i].bool()].tolist()
        r = responses[i, : lens[i]].tolist()
        ids = torch.tensor([q + r])
        with torch.no_grad():
            pl = policy.base_model(ids).logits[0].float() / T
            rl = ref_policy.base_model(ids).logits[0].float() / T
            vh = value_model.base_model.model(ids).last_hidden_state[0]
        for j, tok in enumerate(r):
            pos = len(q) + j - 1
            lp = torch.log_softmax(pl[pos], -1)
            assert torch.allclose(ro["logprobs"][i, j], lp[tok], **tol), (i, j)
            assert torch.allclose(ro["entropies"][i, j], -(lp.exp() * lp).sum(), **tol), (i, j)
            assert torch.allclose(ro["ref_logprobs"][i, j], torch.log_softmax(rl[pos], -1)[tok], **tol), (i, j)
            assert torch.allclose(ro["values"][i, j], value_model.value_head(vh[pos]).squeeze(-1), **tol), (i, j)
        assert torch.all(ro["logprobs"][i, lens[i]:] == 0) and torch.all(ro["ref_logprobs"][i, lens[i]:] == 0)

        text = tokenizer.decode(q, skip_special_tokens=True) + tokenizer.decode(r, skip_special_tokens=True)
        assert text == ro["text_sequences"][i]
        alone = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            h = reward_model.backbone_model.model(alone).last_hidden_state[0, -1]
            reward = reward_model.reward_head(h).squeeze(-1)
        assert torch.allclose(ro["rewards"][i], reward, **tol), (i, ro["rewards"][i], reward)

        kl = [max(float(ro["logprobs"][i, j] - ro["ref_logprobs"][i, j]), 0.0) for j in range(args.response_len)]
        for j in range(args.response_len):
            want = -args.kl_coef * kl[j] + (float(reward) if j == lens[i] - 1 else 0.0)
            assert abs(float(ro["shaped_rewards"][i, j]) - want) < 1e-4, (i, j)

    print("rewards", [round(float(x), 4) for x in ro["rewards"]])
    print("OK")


if __name__ == "__main__":
    main()
