# Citation: allenai/RL4LMs rl4lms/envs/text_generation/observation.py @5c56ddb9300bfc35678d979a14c839776c0dfc92
#   (Observation._concat, Observation.update, Observation.init_from_sample), env.py
#   @0d0970534ab2decadc0fe3bed8db16e78dcd605b (TextGenEnv.step/reset: padding_side = "left", pad = eos),
#   policy/causal_policy.py @0e3a80999b3dacfb7d8fd1b8ca7e69b7f12ef3dd (CausalLMActorCriticPolicy:
#   _prepare_inputs_for_model, forward_policy, forward_value, get_log_probs_ref_model, evaluate_actions,
#   get_inputs_for_generation), policy/base_policy.py @18921bc850972dda2fe68564f9aedd8a2e9ef055 (generate),
#   alg_wrappers.py @01ebafa32ec5d7f8228dc303084fa5fa3a93b7ae (generate_batch: replay the generated actions one
#   step at a time with past_model_kwargs, _add_to_buffer). The model-side helpers RL4LMs relied on are those of
#   the transformers it pinned (4.2x): GPT2LMHeadModel.prepare_inputs_for_generation (position_ids =
#   attention_mask.cumsum(-1) - 1, masked_fill_(attention_mask == 0, 1), last column when past is set) and
#   GenerationMixin._update_model_kwargs_for_generation (past from the output, attention_mask grown by a column of
#   ones); they are written out here because transformers 5 no longer has them.
# PPO for text generation, RL4LMs style: each observation is the left-padded prompt (max_length 8) and the context
# so far (max_length 5) squeezed together by _concat so that all real tokens sit at the right end of a fixed
# 13-token row (1 = real). The rollout generates from those rows (HF generate with the mask), then replays the
# sampled actions step by step with a KV cache (only the newest token goes in; the mask from the first step is
# grown by one column per step and keeps hiding the original left padding), for the policy, the value model and
# the reference model. Training re-reads the stored observations (float32, as the stable-baselines3 buffer keeps
# them) in shuffled minibatches with no cache: each row is a freshly left-padded prompt+context.
# Tiny GPT2 (learned absolute positions, so the mask-derived position_ids matter). Checked against each prompt +
# actions so far run alone, unpadded and with no mask: the replayed log-probs and values, the reference log-probs,
# and the training-time log-probs, values and entropies (PPO ratio exactly 1 on the first epoch).
from copy import deepcopy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

EOS = 63


class ToyTokenizer:
    """Stands in for the GPT2 tokenizer: 'text' is whitespace-separated token ids."""

    def __init__(self):
        self.eos_token_id = EOS
        self.pad_token_id = EOS  # env.py: pad_token = eos_token
        self.padding_side = "left"
        self.truncation_side = "left"

    def __call__(self, text, padding="max_length", max_length=None, return_tensors="pt", return_attention_mask=True,
                 truncation=True):
        ids = [int(t) for t in text.split()]
        if truncation and len(ids) > max_length:
            ids = ids[-max_length:] if self.truncation_side == "left" else ids[:max_length]
        pad = max_length - len(ids)
        if self.padding_side == "left":
            input_ids = [self.pad_token_id] * pad + ids
            mask = [0] * pad + [1] * len(ids)
        else:
            input_ids = ids + [self.pad_token_id] * pad
            mask = [1] * len(ids) + [0] * pad

        class Enc:
            pass
        enc = Enc()
        enc.input_ids = torch.tensor([input_ids])
        enc.attention_mask = torch.tensor([mask])
        return enc

    def _convert_id_to_token(self, i):
        return str(i)

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) == EOS))


@dataclass
class Sample:
    id: str
    prompt_or_input_text: str
    references: List[str]
    meta_data: Dict[str, Any] = None


# ---- rl4lms/envs/text_generation/observation.py
@dataclass
class Observation:
    prompt_or_input_encoded_pt: torch.tensor
    prompt_or_input_attention_mask_pt: torch.tensor
    prompt_or_input_text: str
    context_encoded_pt: torch.tensor
    context_attention_mask_pt: torch.tensor
    context_text: str
    target_or_reference_texts: List[str]
    input_encoded_pt: torch.tensor
    input_attention_mask_pt: torch.tensor
    action_history: List[str]
    meta_info: Dict[str, Any]

    def to_dict(self) -> Dict[str, torch.tensor]:
        dict_obs = {
            "prompt_or_input_encoded_pt": self.prompt_or_input_encoded_pt.numpy().flatten(),
            "prompt_or_input_attention_mask_pt": self.prompt_or_input_attention_mask_pt.numpy().flatten(),
            "context_encoded_pt": self.context_encoded_pt.numpy().flatten(),
            "context_attention_mask_pt": self.context_attention_mask_pt.numpy().flatten(),
            "input_encoded_pt": self.input_encoded_pt.numpy().flatten(),
            "input_attention_mask_pt": self.input_attention_mask_pt.numpy().flatten()
        }
        return dict_obs

    @staticmethod
    def _concat(prompt: torch.tensor, prompt_mask: torch.tensor,
                context: torch.tensor, context_mask: torch.tensor,
                pad_token: int):

        prompt_ = prompt[:, prompt_mask.flatten().bool().tolist()]
        context_ = context[:, context_mask.flatten().bool().tolist()]
        actual_size = prompt_.shape[1] + context_.shape[1]

        full_size = prompt.shape[1] + context.shape[1]
        concatenated = torch.full((full_size,), fill_value=pad_token).reshape(1, -1)
        concatenated_mask = torch.zeros((1, full_size)).int()

        concatenated[:, full_size - actual_size:] = torch.cat((prompt_, context_), dim=1)
        concatenated_mask[:, full_size - actual_size:] = 1
        return concatenated, concatenated_mask

    def update(self, action: int, tokenizer) -> "Observation":
        current_action_history = deepcopy(self.action_history)
        if isinstance(action, np.int64):
            action = action.item()
        current_action_history.append(tokenizer._convert_id_to_token(action))

        current_context = deepcopy(self.context_encoded_pt)
        current_context_attention_mask = deepcopy(self.context_attention_mask_pt)

        # just shift the context (also the attention mask) to left by 1
        current_context[:, 0:-1] = current_context[:, 1:].clone()
        current_context_attention_mask[:, 0:-1] = current_context_attention_mask[:, 1:].clone()

        # add the action always at the end (assumes left padding)
        current_context[:, -1] = action
        current_context_attention_mask[:, -1] = 1

        context_text = tokenizer.decode(current_context.flatten(), skip_special_tokens=True)

        # concatenate and still keep the left padding
        input_encoded_pt, input_attention_mask_pt = Observation._concat(
            self.prompt_or_input_encoded_pt, self.prompt_or_input_attention_mask_pt,
            current_context, current_context_attention_mask,
            tokenizer.pad_token_id)

        obs = Observation(self.prompt_or_input_encoded_pt,
                          self.prompt_or_input_attention_mask_pt,
                          self.prompt_or_input_text,
                          current_context,
                          current_context_attention_mask,
                          context_text,
                          self.target_or_reference_texts,
                          input_encoded_pt,
                          input_attention_mask_pt,
                          current_action_history,
                          self.meta_info)
        return obs

    @classmethod
    def init_from_sample(cls, sample: Sample, tokenizer, max_input_length: int, max_context_length: int,
                         prompt_truncation_side: str, context_start_token: int = None,
                         meta_info: Dict[str, Any] = None):
        prev_truncation_side = tokenizer.truncation_side
        tokenizer.truncation_side = prompt_truncation_side
        prompt_outputs = tokenizer(sample.prompt_or_input_text, padding="max_length", max_length=max_input_length,
                                   return_tensors="pt", return_attention_mask=True, truncation=True)
        tokenizer.truncation_side = prev_truncation_side

        context_outputs = tokenizer("", padding="max_length", max_length=max_context_length,
                                    return_tensors="pt", return_attention_mask=True)

        input_encoded_pt, input_attention_mask_pt = Observation._concat(
            prompt_outputs.input_ids, prompt_outputs.attention_mask,
            context_outputs.input_ids, context_outputs.attention_mask,
            tokenizer.pad_token_id)

        obs = Observation(prompt_or_input_encoded_pt=prompt_outputs.input_ids,
                          prompt_or_input_attention_mask_pt=prompt_outputs.attention_mask,
                          prompt_or_input_text=sample.prompt_or_input_text,
                          context_encoded_pt=context_outputs.input_ids,
                          context_attention_mask_pt=context_outputs.attention_mask,
                          input_encoded_pt=input_encoded_pt,
                          input_attention_mask_pt=input_attention_mask_pt,
                          context_text="",
                          target_or_reference_texts=sample.references,
                          action_history=[],
                          meta_info=meta_info)
        return obs


# ---- rl4lms/envs/text_generation/env.py (TextGenEnv.reset / step, reward left out)
class TextGenEnv:
    def __init__(self, tokenizer, max_episode_length, max_prompt_length, terminate_on_eos=False,
                 prompt_truncation_side="left"):
        self.tokenizer = tokenizer
        self.max_steps = max_episode_length
        self._max_text_length = max_prompt_length
        self._terminate_on_eos = terminate_on_eos
        self._prompt_truncation_side = prompt_truncation_side
        self.tokenizer.padding_side = "left"
        self.tokenizer.truncation_side = "left"

    def step(self, action: int):
        self.__time_step += 1
        previous_obs = self.__current_obs
        self.__current_obs = self.__current_obs.update(action, self.tokenizer)
        done = (action == self.tokenizer.eos_token_id and self._terminate_on_eos) or (
            self.__time_step == self.max_steps)
        info = {"output": self.__current_obs.context_text, "prev_output": previous_obs.context_text}
        return self.__current_obs.to_dict(), 0.0, done, info

    def reset(self, sample: Sample):
        self.__current_obs = Observation.init_from_sample(sample, self.tokenizer, self._max_text_length,
                                                          self.max_steps, self._prompt_truncation_side, None,
                                                          sample.meta_data)
        self.__time_step = 0
        return self.__current_obs.to_dict()


# ---- transformers 4.2x GPT2LMHeadModel.prepare_inputs_for_generation (what unwrap_model(model) resolved to)
def prepare_inputs_for_generation(input_ids, past=None, **kwargs):
    token_type_ids = kwargs.get("token_type_ids", None)
    # only last token for inputs_ids if past is defined in kwargs
    if past:
        input_ids = input_ids[:, -1].unsqueeze(-1)
        if token_type_ids is not None:
            token_type_ids = token_type_ids[:, -1].unsqueeze(-1)

    attention_mask = kwargs.get("attention_mask", None)
    position_ids = kwargs.get("position_ids", None)

    if attention_mask is not None and position_ids is None:
        # create position_ids on the fly for batch generation
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        if past:
            position_ids = position_ids[:, -1].unsqueeze(-1)
    else:
        position_ids = None
    return {
        "input_ids": input_ids,
        "past_key_values": past,
        "use_cache": kwargs.get("use_cache"),
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "token_type_ids": token_type_ids,
    }


# ---- transformers 4.2x GenerationMixin._update_model_kwargs_for_generation
def _update_model_kwargs_for_generation(outputs, model_kwargs: Dict[str, Any], is_encoder_decoder: bool = False):
    # update past
    if "past_key_values" in outputs:
        model_kwargs["past"] = outputs.past_key_values
    else:
        model_kwargs["past"] = None
    # update attention mask
    if not is_encoder_decoder:
        if "attention_mask" in model_kwargs:
            attention_mask = model_kwargs["attention_mask"]
            model_kwargs["attention_mask"] = torch.cat(
                [attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
    return model_kwargs


@dataclass
class PolicyOutput:
    actions: torch.tensor
    raw_log_probs: torch.tensor
    log_probs: torch.tensor
    entropy: torch.tensor
    past_model_kwargs: torch.tensor


@dataclass
class ValueOutput:
    values: torch.tensor
    past_model_kwargs: Dict[str, torch.tensor]


@dataclass
class RefPolicyOutput:
    log_probs: torch.tensor
    past_model_kwargs: torch.tensor


@dataclass
class EvaluateActionsOutput:
    values: torch.tensor
    log_prob: torch.tensor
    entropy: torch.tensor


@dataclass
class GenerationInputs:
    inputs: torch.tensor
    attention_masks: torch.tensor


# ---- rl4lms/envs/text_generation/policy/causal_policy.py (+ base_policy.generate)
class CausalLMActorCriticPolicy(nn.Module):
    def __init__(self, config: GPT2Config, generation_kwargs: Dict[str, Any]):
        super().__init__()
        self._generation_kwargs = generation_kwargs
        self._build_model_heads(config)

    def _build_model_heads(self, config):
        self._policy_model = GPT2LMHeadModel(config).eval()
        self._value_model = GPT2LMHeadModel(config).eval()
        self._ref_model = deepcopy(self._policy_model).eval()
        self._value_head = nn.Linear(self._value_model.config.hidden_size, 1, bias=False)

    def _prepare_inputs_for_model(self, model, input_ids: torch.tensor,
                                  model_kwargs: Optional[Dict[str, torch.tensor]] = None):
        model_inputs = prepare_inputs_for_generation(input_ids, **model_kwargs)
        return model_inputs

    def _action_dist(self, action_logits):
        return Categorical(logits=action_logits)

    def forward_policy(self, obs, actions: torch.tensor = None,
                       past_model_kwargs: Optional[Dict[str, torch.tensor]] = None) -> PolicyOutput:
        input_ids = obs["input_encoded_pt"].int()
        attention_mask = obs["input_attention_mask_pt"]

        if not past_model_kwargs:
            # take attention mask only for the first step
            # for subsequent steps, update_model_kwargs will handle it
            past_model_kwargs = {
                "attention_mask": attention_mask,
            }
        model_inputs = self._prepare_inputs_for_model(self._policy_model, input_ids, past_model_kwargs)

        output = self._policy_model(output_hidden_states=True, **model_inputs)

        if actions is not None:
            next_token_logits = output.logits[:, -1, :]
            dist = self._action_dist(next_token_logits)
            entropy = dist.entropy()
            log_prob = dist.log_prob(actions)
        else:
            log_prob = None
            entropy = None

        past_model_kwargs = _update_model_kwargs_for_generation(
            output, past_model_kwargs, is_encoder_decoder=self._policy_model.config.is_encoder_decoder)

        return PolicyOutput(actions=actions, raw_log_probs=log_prob, log_probs=log_prob, entropy=entropy,
                            past_model_kwargs=past_model_kwargs)

    def forward_value(self, obs, past_model_kwargs: Optional[Dict[str, torch.tensor]] = None) -> ValueOutput:
        input_ids = obs["input_encoded_pt"].int()
        attention_mask = obs["input_attention_mask_pt"]

        if not past_model_kwargs:
            past_model_kwargs = {
                "attention_mask": attention_mask,
            }
        model_inputs = self._prepare_inputs_for_model(self._value_model, input_ids, past_model_kwargs)

        output = self._value_model(output_hidden_states=True, **model_inputs)

        # pool the hidden states ?
        last_tokens_hidden = output.hidden_states[-1][:, -1, :]
        values = self._value_head.forward(last_tokens_hidden)

        past_model_kwargs = _update_model_kwargs_for_generation(
            output, past_model_kwargs, is_encoder_decoder=self._value_model.config.is_encoder_decoder)
        return ValueOutput(values=values, past_model_kwargs=past_model_kwargs)

    def evaluate_actions(self, obs: torch.Tensor, actions: torch.Tensor) -> EvaluateActionsOutput:
        policy_outputs = self.forward_policy(obs=obs, actions=actions)
        value_outputs = self.forward_value(obs)
        return EvaluateActionsOutput(values=value_outputs.values, log_prob=policy_outputs.log_probs,
                                     entropy=policy_outputs.entropy)

    def get_log_probs_ref_model(self, obs, action: torch.tensor,
                                past_model_kwargs: Dict[str, Any] = None) -> RefPolicyOutput:
        self._ref_model = self._ref_model.eval()

        input_ids = obs["input_encoded_pt"]
        attention_mask = obs["input_attention_mask_pt"]

        if not past_model_kwargs:
            past_model_kwargs = {
                "attention_mask": attention_mask,
            }
        model_inputs = self._prepare_inputs_for_model(self._ref_model, input_ids, past_model_kwargs)
        output = self._ref_model(output_hidden_states=True, **model_inputs)
        next_token_logits = output.logits[:, -1, :]
        dist = self._action_dist(next_token_logits)
        log_prob = dist.log_prob(action)

        past_model_kwargs = _update_model_kwargs_for_generation(
            output, past_model_kwargs, is_encoder_decoder=self._ref_model.config.is_encoder_decoder)
        return RefPolicyOutput(log_prob, past_model_kwargs)

    def get_inputs_for_generation(self, obs):
        return GenerationInputs(obs["input_encoded_pt"].int(), obs["input_attention_mask_pt"].int())

    def generate(self, tokenizer, input_ids: torch.tensor = None, attention_mask: torch.tensor = None,
                 gen_kwargs: Dict[str, Any] = None):
        if gen_kwargs is None:
            gen_kwargs = self._generation_kwargs
        self._policy_model.eval()
        if "min_length" in gen_kwargs.keys() and not self._policy_model.config.is_encoder_decoder:
            generation_kwargs_ = deepcopy(gen_kwargs)
            generation_kwargs_["min_length"] = input_ids.shape[1] + gen_kwargs["min_length"]
        else:
            generation_kwargs_ = gen_kwargs

        gen_output = self._policy_model.generate(
            inputs=input_ids,
            attention_mask=attention_mask,
            return_dict_in_generate=True,
            output_scores=True,
            pad_token_id=tokenizer.pad_token_id,
            **generation_kwargs_,
        )
        seq_length = len(gen_output["scores"])
        gen_tokens = gen_output["sequences"][:, -seq_length:]
        step_wise_actions = [gen_tokens[:, step] for step in range(seq_length)]
        return gen_tokens, step_wise_actions


def obs_as_tensor(obs_list):
    return {k: torch.as_tensor(np.stack([o[k] for o in obs_list])) for k in obs_list[0]}


def reference_forward(policy, prefix_ids):
    ids = torch.tensor([prefix_ids])
    out_p = policy._policy_model(input_ids=ids)
    out_r = policy._ref_model(input_ids=ids)
    out_v = policy._value_model(input_ids=ids, output_hidden_states=True)
    dist = Categorical(logits=out_p.logits[0, -1])
    value = policy._value_head(out_v.hidden_states[-1][0, -1])[0]
    return dist, Categorical(logits=out_r.logits[0, -1]), value


def main():
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=EOS,
                        eos_token_id=EOS, pad_token_id=EOS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    max_prompt_length, max_steps = 8, 5
    policy = CausalLMActorCriticPolicy(config, generation_kwargs={"do_sample": True, "top_k": 50,
                                                                   "max_new_tokens": max_steps,
                                                                   "min_length": max_steps})
    tokenizer = ToyTokenizer()
    samples = [Sample("0", "5 9 12", ["x"]), Sample("1", "3 14 15 9 26 5", ["x"]), Sample("2", "27 18 28", ["x"]),
               Sample("3", "40 41 42 43 44 45 46 47 48 49", ["x"])]  # the last is truncated on the left to 8
    envs = [TextGenEnv(ToyTokenizer(), max_steps, max_prompt_length) for _ in samples]

    with torch.no_grad():
        # ---- alg_wrappers.generate_batch
        current_obs = [env.reset(s) for env, s in zip(envs, samples)]
        obs_tensor = obs_as_tensor(current_obs)
        generation_inputs = policy.get_inputs_for_generation(obs_tensor)
        torch.manual_seed(1)
        gen_tokens, step_wise_actions = policy.generate(tokenizer, input_ids=generation_inputs.inputs,
                                                        attention_mask=generation_inputs.attention_masks)
        value_past_state = ref_past_state = policy_past_state = None
        transitions = [[] for _ in envs]
        for actions_tensor in step_wise_actions:
            obs_tensor = obs_as_tensor(current_obs)
            policy_outputs = policy.forward_policy(obs_tensor, actions_tensor, policy_past_state)
            log_probs, policy_past_state = policy_outputs.log_probs, policy_outputs.past_model_kwargs
            value_outputs = policy.forward_value(obs_tensor, value_past_state)
            values, value_past_state = value_outputs.values, value_outputs.past_model_kwargs
            ref_outputs = policy.get_log_probs_ref_model(obs_tensor, actions_tensor, ref_past_state)
            ref_log_probs, ref_past_state = ref_outputs.log_probs, ref_outputs.past_model_kwargs

            actions = actions_tensor.cpu().numpy()
            new_obs = []
            for env_ix, env in enumerate(envs):
                o, _, done, _ = env.step(actions[env_ix])
                new_obs.append(o)
                transitions[env_ix].append(dict(observation=current_obs[env_ix], action=actions[env_ix],
                                                value=values[env_ix, 0], log_prob=log_probs[env_ix],
                                                ref_log_prob=ref_log_probs[env_ix]))
            current_obs = new_obs

        # ---- reference: prompt + actions so far, alone, unpadded, no mask
        max_diff = 0.0
        refs = {}
        for env_ix, s in enumerate(samples):
            prompt = [int(t) for t in s.prompt_or_input_text.split()][-max_prompt_length:]
            acts = gen_tokens[env_ix].tolist()
            for t, tr in enumerate(transitions[env_ix]):
                dist, ref_dist, value = reference_forward(policy, prompt + acts[:t])
                a = torch.tensor(acts[t])
                refs[(env_ix, t)] = (dist.log_prob(a), dist.entropy(), value)
                for got, want in ((tr["log_prob"], dist.log_prob(a)), (tr["ref_log_prob"], ref_dist.log_prob(a)),
                                  (tr["value"], value)):
                    d = (got - want).abs().item()
                    max_diff = max(max_diff, d)
                    assert d < 1e-10, (env_ix, t, d)

        # ---- _add_to_buffer (stable-baselines3 DictRolloutBuffer keeps observations as float32) + PPO minibatches
        flat = [(env_ix, t, tr) for env_ix in range(len(envs)) for t, tr in enumerate(transitions[env_ix])]
        buffer_obs = {k: np.stack([tr["observation"][k] for _, _, tr in flat]).astype(np.float32)
                      for k in flat[0][2]["observation"]}
        buffer_actions = torch.tensor(np.array([tr["action"] for _, _, tr in flat]))
        old_log_prob = torch.stack([tr["log_prob"] for _, _, tr in flat])
        perm = torch.randperm(len(flat))
        batch_size = 6
        for start in range(0, len(flat), batch_size):
            idx = perm[start:start + batch_size]
            observations = {k: torch.as_tensor(v[idx.numpy()]) for k, v in buffer_obs.items()}
            eval_out = policy.evaluate_actions(observations, buffer_actions[idx])
            ratio = torch.exp(eval_out.log_prob - old_log_prob[idx])
            assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-10, rtol=0)
            for j, i in enumerate(idx.tolist()):
                env_ix, t, _ = flat[i]
                lp, ent, val = refs[(env_ix, t)]
                for got, want in ((eval_out.log_prob[j], lp), (eval_out.entropy[j], ent),
                                  (eval_out.values[j, 0], val)):
                    d = (got - want).abs().item()
                    max_diff = max(max_diff, d)
                    assert d < 1e-10, (env_ix, t, d)

    # the rows really are padded differently from one another
    m = torch.as_tensor(buffer_obs["input_attention_mask_pt"])
    assert (m == 0).any(dim=1).all() and len(set(m.sum(1).tolist())) > 3
    print(f"ok: RL4LMs left-packed observations, cached rollout replay and training forward match each "
          f"prompt+actions alone (max diff {max_diff:.2e})")


if __name__ == "__main__":
    main()
