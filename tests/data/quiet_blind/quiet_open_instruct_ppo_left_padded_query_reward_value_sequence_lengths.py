# Citation: allenai/open-instruct @004a48d5fd23bea6bccbbff31e2a8a425dcf675e: open_instruct/model_utils.py
#   (first_true_indices, get_reward, truncate_response), open_instruct/ppo_vllm_thread_ray_gtrl.py
#   (PolicyTrainerRayProcess.forward, the rollout block of PolicyTrainerRayProcess.train: DUMMY_PAD_TOKEN padding of
#   the vLLM responses, truncate_response, get_reward on the reward and value models, padding_mask /
#   padding_mask_p1, rewards at actual_end, GAE; masked_mean / masked_var / masked_whiten);
#   open_instruct/dataset_processor.py @00f10bacaee09ff5f0e4d3fa128da9a29985c663 (SimpleGenerateCollatorWithGroundTruth).
# One PPO rollout as open-instruct scores it. Prompts are LEFT-padded with pad_token_id by the collator; vLLM's
# responses are right-padded to response_length with the stop token (DUMMY_PAD_TOKEN, since pad is outside the
# vocab of the logprob gather) and appended, so `context_length` is one column shared by all rows. Every model call
# rebuilds the mask from the ids (`query_response != pad_token_id`), with exclusive-cumsum position ids and pad ids
# replaced by 0. The reward model runs on the truncated response (pads after the first stop token) and is read at
# `first_true_indices(response == pad) - 1 + context_length`, the stop token; the value model runs on the untruncated
# rows (their stop-token padding is attended, but only after the positions that are kept) and its values are sliced
# `[context_length - 1 : -1]` and zeroed past sequence_length + 1; logprobs past sequence_length are INVALID_LOGPROB.
# Self-check: each (prompt, response) run alone without padding or mask: end score at its last token, values and
# logprobs at its own response positions, and the rewards, advantages and returns rebuilt by a per-sample loop.
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

torch.manual_seed(0)

INPUT_IDS_PROMPT_KEY = "input_ids_prompt"
GROUND_TRUTHS_KEY = "ground_truth"
INVALID_LOGPROB = 1.0


# ---- open_instruct/dataset_processor.py ----
class SimpleGenerateCollatorWithGroundTruth:
    """Simple collator for generation task (always pad from the LEFT)"""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[dict]):
        max_length = -1
        for i in range(len(batch)):
            max_length = max(max_length, len(batch[i][INPUT_IDS_PROMPT_KEY]))
        assert max_length > 0, "the dataset is empty"
        padded_sequences = []
        for i in range(len(batch)):
            pad_length = max_length - len(batch[i][INPUT_IDS_PROMPT_KEY])
            padding = [self.pad_token_id] * pad_length
            padded_sequence = padding + batch[i][INPUT_IDS_PROMPT_KEY]
            padded_sequences.append(padded_sequence)
        padded_sequences = torch.tensor(padded_sequences)
        ground_truths = [x[GROUND_TRUTHS_KEY] for x in batch]
        return {INPUT_IDS_PROMPT_KEY: padded_sequences, GROUND_TRUTHS_KEY: ground_truths}


# ---- open_instruct/model_utils.py ----
def first_true_indices(bools: torch.Tensor, dtype=torch.long) -> torch.Tensor:
    row_len = bools.size(-1)
    zero_or_index = row_len * (~bools).type(dtype) + torch.arange(row_len, dtype=dtype, device=bools.device)
    return torch.min(zero_or_index, dim=-1).values


def get_reward(model, query_responses, pad_token_id, context_length):
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()  # exclusive cumsum
    lm_backbone = getattr(model, model.base_model_prefix)
    input_ids = torch.masked_fill(query_responses, ~attention_mask, 0)
    output = lm_backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        return_dict=True,
        output_hidden_states=True,
        use_cache=False,
    )
    reward_logits = model.score(output.hidden_states[-1])
    sequence_lengths = first_true_indices(query_responses[:, context_length:] == pad_token_id) - 1 + context_length
    assert reward_logits.shape[-1] == 1
    return (
        reward_logits,
        reward_logits[torch.arange(reward_logits.size(0), device=reward_logits.device), sequence_lengths].squeeze(-1),
        sequence_lengths,
    )


def truncate_response(stop_token_id: int, pad_token_id: int, responses: torch.Tensor):
    trunc_idxs = first_true_indices(responses == stop_token_id).unsqueeze(-1)
    new_size = [1] * (len(responses.size()) - 1) + [responses.shape[1]]
    idxs = torch.arange(responses.shape[1], device=responses.device).view(*new_size)
    postprocessed_responses = torch.masked_fill(responses, idxs > trunc_idxs, pad_token_id)
    return postprocessed_responses


def log_softmax_and_gather(logits, index):
    logprobs = logits.log_softmax(dim=-1)
    return torch.gather(logprobs, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)


# ---- open_instruct/ppo_vllm_thread_ray_gtrl.py ----
def masked_mean(values, mask, axis=None):
    if axis is not None:
        return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
    else:
        return (values * mask).sum() / mask.sum()


def masked_var(values, mask, unbiased=True):
    mean = masked_mean(values, mask)
    centered_values = values - mean
    variance = masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def masked_whiten(values, mask, shift_mean=True):
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def policy_forward(model, query_response, response, pad_token_id, context_length, temperature):
    """PolicyTrainerRayProcess.forward"""
    attention_mask = query_response != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = torch.masked_fill(query_response, ~attention_mask, 0)
    output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, return_dict=True)
    logits = output.logits[:, context_length - 1 : -1]
    logits /= temperature + 1e-7
    logprob = log_softmax_and_gather(logits, response)
    return logprob


class Args:
    response_length = 8
    stop_token_id = 2
    temperature = 0.7
    beta = 0.05
    gamma = 1.0
    lam = 0.95
    reward_model_multiplier = 1.0
    non_stop_penalty = True
    penalty_reward_value = -1.0
    min_response_length = 0
    local_rollout_forward_batch_size = 2


def rollout(args, policy, ref_policy, reward_model, value_model, queries, g_response_token_ids, pad_token_id):
    """The no-grad block of PolicyTrainerRayProcess.train (one rank, no verifiable reward)."""
    device = queries.device
    context_length = queries.shape[1]
    DUMMY_PAD_TOKEN = args.stop_token_id
    g_padded_response_ids = [
        response + [DUMMY_PAD_TOKEN] * (args.response_length - len(response)) for response in g_response_token_ids
    ]
    local_vllm_responses = torch.tensor(g_padded_response_ids, device=device)
    query_responses = torch.cat((queries, local_vllm_responses), 1)
    responses, postprocessed_responses, logprobs, ref_logprobs = [], [], [], []
    scores, sequence_lengths, values = [], [], []
    for i in range(0, queries.shape[0], args.local_rollout_forward_batch_size):
        query = queries[i : i + args.local_rollout_forward_batch_size]
        query_response = query_responses[i : i + args.local_rollout_forward_batch_size]
        response = query_response[:, context_length:]
        logprob = policy_forward(policy, query_response, response, pad_token_id, context_length, args.temperature)
        ref_logprob = policy_forward(ref_policy, query_response, response, pad_token_id, context_length,
                                     args.temperature)
        postprocessed_response = response
        if args.stop_token_id is not None:
            postprocessed_response = truncate_response(args.stop_token_id, pad_token_id, response)
        postprocessed_query_response = torch.cat((query, postprocessed_response), 1)
        sequence_length = first_true_indices(postprocessed_response == pad_token_id) - 1
        score = torch.zeros(query.shape[0], device=query.device)
        if args.reward_model_multiplier:
            _, score, _ = get_reward(reward_model, postprocessed_query_response, pad_token_id, context_length)
            score *= args.reward_model_multiplier
        full_value, _, _ = get_reward(value_model, query_response, pad_token_id, context_length)
        value = full_value[:, context_length - 1 : -1].squeeze(-1)
        responses.append(response)
        postprocessed_responses.append(postprocessed_response)
        logprobs.append(logprob)
        ref_logprobs.append(ref_logprob)
        sequence_lengths.append(sequence_length)
        scores.append(score)
        values.append(value)
    responses = torch.cat(responses, 0)
    postprocessed_responses = torch.cat(postprocessed_responses, 0)
    logprobs = torch.cat(logprobs, 0)
    ref_logprobs = torch.cat(ref_logprobs, 0)
    sequence_lengths = torch.cat(sequence_lengths, 0)
    scores = torch.cat(scores, 0)
    values = torch.cat(values, 0)
    raw_scores = scores.clone()

    contain_stop_token = torch.any(postprocessed_responses == args.stop_token_id, dim=-1)
    contain_stop_token = contain_stop_token & (sequence_lengths >= args.min_response_length)
    if args.non_stop_penalty:
        scores = torch.where(contain_stop_token, scores, torch.full_like(scores, args.penalty_reward_value))

    response_idxs = torch.arange(responses.shape[1], device=responses.device).repeat(responses.shape[0], 1)
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
    sequence_lengths_p1 = sequence_lengths + 1
    padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
    values = torch.masked_fill(values, padding_mask_p1, 0)

    kl = logprobs - ref_logprobs  # kl1
    non_score_reward = -args.beta * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0), device=rewards.device)
    actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)
    rewards[(actual_start, actual_end)] += scores  # the list index of the source, written as a tuple

    lastgaelam = 0
    advantages_reversed = []
    gen_length = responses.shape[1]
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + args.gamma * nextvalues - values[:, t]
        lastgaelam = delta + args.gamma * args.lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    raw_advantages = advantages.clone()
    advantages = masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return dict(context_length=context_length, raw_scores=raw_scores, scores=scores,
                sequence_lengths=sequence_lengths, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values,
                rewards=rewards, raw_advantages=raw_advantages, advantages=advantages, returns=returns,
                padding_mask=padding_mask, postprocessed_responses=postprocessed_responses)


def alone_reference(args, policy, ref_policy, reward_model, value_model, prompt, response_ids):
    """One (prompt, response) with no padding at all and no attention mask."""
    R = args.response_length
    full = response_ids + [args.stop_token_id] * (R - len(response_ids))  # what the value/policy rows hold
    stop_at = full.index(args.stop_token_id) if args.stop_token_id in full else R - 1
    truncated = full[: stop_at + 1]
    q = len(prompt)
    ids_full = torch.tensor([prompt + full])
    ids_trunc = torch.tensor([prompt + truncated])
    with torch.no_grad():
        hidden = reward_model.model(input_ids=ids_trunc).last_hidden_state
        end_score = reward_model.score(hidden)[0, -1, 0]
        vhidden = value_model.model(input_ids=ids_full).last_hidden_state
        v_all = value_model.score(vhidden)[0, :, 0]
        lp = F.log_softmax(policy(input_ids=ids_full).logits[0] / (args.temperature + 1e-7), -1)
        rlp = F.log_softmax(ref_policy(input_ids=ids_full).logits[0] / (args.temperature + 1e-7), -1)
    seq_len = len(truncated) - 1
    logprob = [float(lp[q - 1 + t, full[t]]) if t <= seq_len else INVALID_LOGPROB for t in range(R)]
    ref_logprob = [float(rlp[q - 1 + t, full[t]]) if t <= seq_len else INVALID_LOGPROB for t in range(R)]
    value = [float(v_all[q - 1 + t]) if t <= seq_len + 1 else 0.0 for t in range(R)]
    has_stop = args.stop_token_id in truncated
    score = float(end_score) if has_stop else args.penalty_reward_value
    reward = [-args.beta * (logprob[t] - ref_logprob[t]) for t in range(R)]
    end = seq_len + 1 if seq_len + 1 < R else seq_len
    reward[end] += score
    adv = [0.0] * R
    last = 0.0
    for t in range(R - 1, -1, -1):
        nxt = value[t + 1] if t < R - 1 else 0.0
        last = reward[t] + args.gamma * nxt - value[t] + args.gamma * args.lam * last
        adv[t] = last
    return dict(seq_len=seq_len, end_score=float(end_score), score=score, logprob=logprob,
                ref_logprob=ref_logprob, value=value, reward=reward, adv=adv,
                ret=[adv[t] + value[t] for t in range(R)])


def main():
    args = Args()
    pad_token_id = 0
    cfg = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=pad_token_id, eos_token_id=2,
               bos_token_id=1, attn_implementation="sdpa")
    policy = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    ref_policy = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    reward_model = LlamaForSequenceClassification(LlamaConfig(num_labels=1, **cfg)).eval()
    value_model = LlamaForSequenceClassification(LlamaConfig(num_labels=1, **cfg)).eval()

    g = torch.Generator().manual_seed(1)

    def toks(n):
        return torch.randint(3, 48, (n,), generator=g).tolist()

    prompts = [[1] + toks(2), [1] + toks(6), [1] + toks(4), [1] + toks(1)]
    # what vLLM handed back: stop token included when it stopped, none when it ran out of response_length
    responses = [toks(4) + [2], toks(8), [2], toks(2) + [2]]
    batch = [{INPUT_IDS_PROMPT_KEY: p, GROUND_TRUTHS_KEY: ""} for p in prompts]
    data = SimpleGenerateCollatorWithGroundTruth(pad_token_id)(batch)
    queries = data[INPUT_IDS_PROMPT_KEY]
    assert queries.shape == (4, 7) and int(queries[3, 0]) == pad_token_id

    with torch.no_grad():
        out = rollout(args, policy, ref_policy, reward_model, value_model, queries, responses, pad_token_id)

    tol = dict(rtol=1e-4, atol=1e-5)
    all_adv, all_mask = [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ref = alone_reference(args, policy, ref_policy, reward_model, value_model, p, r)
        assert int(out["sequence_lengths"][i]) == ref["seq_len"], (i, out["sequence_lengths"][i], ref["seq_len"])
        torch.testing.assert_close(out["raw_scores"][i], torch.tensor(ref["end_score"]), **tol)
        torch.testing.assert_close(out["scores"][i], torch.tensor(ref["score"]), **tol)
        for key, rkey in [("logprobs", "logprob"), ("ref_logprobs", "ref_logprob"), ("values", "value"),
                          ("rewards", "reward"), ("raw_advantages", "adv"), ("returns", "ret")]:
            torch.testing.assert_close(out[key][i], torch.tensor(ref[rkey]), **tol, msg=lambda m: f"{key}[{i}]: {m}")
        all_adv.extend(ref["adv"][: ref["seq_len"] + 1])
    a = torch.tensor(all_adv)
    whitened_ref = (a - a.mean()) / torch.sqrt(a.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(out["advantages"][~out["padding_mask"]], whitened_ref, **tol)
    assert bool((out["advantages"][out["padding_mask"]] == 0).all())
    print("ok: end scores, logprobs, values, rewards, advantages and returns of 4 left-padded rollouts match each "
          "run alone; scores", [round(float(s), 4) for s in out["scores"]])


if __name__ == "__main__":
    main()
