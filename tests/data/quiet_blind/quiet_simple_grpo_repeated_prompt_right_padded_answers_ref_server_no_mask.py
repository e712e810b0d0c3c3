# Citation: lsdefine/simple_GRPO @4ab94c64765a33f73a2c285d1285f935fd299ef2: grpo_vllm_one.py (gen_worker's
#   tensor path: pad_sequence of the vLLM answers' token_ids with tokenizer.pad_token_id, Qrep =
#   prompt_ids.repeat(1, n).view(-1, plen), merged_ids = cat([Qrep, output_ids]), gen_logps from vLLM
#   prompt_logprobs[plen:]; get_per_token_logps; GRPO_step), ref_server.py (the reference model's
#   get_per_token_logps over the uploaded batch, sliced [:, prompt_length-1:]).
# One GSM8K-style question per group: its chat prompt (no padding: every row of a batch is the same prompt) is
# repeated num_pre_Q times, the sampled answers (each ending in <|im_end|>) are right-padded with <|endoftext|>,
# and the policy, the reference server and the vLLM log-prob pass all run the merged rows with no attention
# mask at all: right padding under a causal model never reaches a real token. completion_mask =
# answer ids != pad_token_id keeps the answer tokens and their <|im_end|> (a Qwen2.5-Instruct tokenizer: pad
# <|endoftext|> differs from eos <|im_end|>). The tiny Qwen2 (Qwen2Config, attn_implementation="sdpa")
# stands in for Qwen2.5-7B, a hand-written per-answer sampler for vLLM's SamplingParams(n=num_pre_Q), and a
# plain AdamW step for the DeepSpeed engine; the generation copy is not refreshed (gen_update_steps = 16), so
# the later steps are off-policy and the clipped ratio is not 1.
# Checked against each answer run alone (prompt + its own answer, no padding, no mask): the policy's, the
# reference's and the generation model's log-probs of every answer token, then each step's loss and
# gradients against a double loop over rows and answer tokens.
import copy
import sys

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(0)
torch.set_num_threads(2)
torch.set_default_dtype(torch.float64)

VOCAB = 32
IM_START, ENDOFTEXT, IM_END = 29, 30, 31  # <|im_start|>, <|endoftext|> (pad), <|im_end|> (eos)
SYSTEM, USER, ASSISTANT = 26, 27, 28


class Tok:
    pad_token_id = ENDOFTEXT
    eos_token_id = IM_END


tokenizer = Tok()

beta = 0.04
Q_batch_size = 3
num_pre_Q = 8
train_batch_size = 4
max_tokens = 14
clip_param = 0.2
compute_gen_logps = True

config = Qwen2Config(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, pad_token_id=ENDOFTEXT, eos_token_id=IM_END,
    bos_token_id=ENDOFTEXT, tie_word_embeddings=False, attn_implementation="sdpa",
)
model = Qwen2ForCausalLM(config)
model.train()
engine = model
ref_model = copy.deepcopy(model)
ref_model.eval()
ref_model.requires_grad_(False)
vllm_model = copy.deepcopy(model)  # the generation worker's weights, refreshed every gen_update_steps
vllm_model.eval()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)


# ---- grpo_vllm_one.py
def get_per_token_logps(logits, input_ids):
    per_token_logps = []  # Use a loop to reduce memory peak.
    for logits_row, input_ids_row in zip(logits, input_ids):
        log_probs = logits_row.log_softmax(dim=-1)
        token_log_prob = torch.gather(log_probs, dim=1, index=input_ids_row.unsqueeze(1)).squeeze(1)
        per_token_logps.append(token_log_prob)
    return torch.stack(per_token_logps)


def GRPO_step(batch):
    prompt_length = batch['plen']
    inputs = batch['inputs']
    advantages = batch['rewards'].unsqueeze(1)
    logits = engine(inputs).logits
    logits = logits[:, :-1, :]  # (B, L-1, V), exclude the last logit: it corresponds to the next token pred
    input_ids = inputs[:, 1:]  # (B, L-1), exclude the first input ID since we don't have logits for it
    per_token_logps = get_per_token_logps(logits, input_ids)
    per_token_logps = per_token_logps[:, prompt_length - 1:]
    ref_per_token_logps = batch['refs']
    per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    completion_mask = (inputs[:, prompt_length:] != tokenizer.pad_token_id).int()
    if 'gen_logps' in batch:
        ratio = torch.exp(per_token_logps - batch['gen_logps'])
        clipped_ratio = torch.clamp(ratio, 1 - clip_param, 1 + clip_param)
        per_token_loss = torch.min(ratio * advantages, clipped_ratio * advantages)
    else:
        per_token_loss = torch.exp(per_token_logps - per_token_logps.detach()) * advantages
        assert compute_gen_logps is False
    per_token_loss = -(per_token_loss - beta * per_token_kl)
    loss = ((per_token_loss * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)).mean()
    return loss, per_token_logps


# ---- ref_server.py
def ref_get_per_token_logps(input_ids):
    logits = ref_model(input_ids).logits  # (B, L, V)
    logits = logits[:, :-1, :]
    input_ids = input_ids[:, 1:]
    per_token_logps = []
    for logits_row, input_ids_row in zip(logits, input_ids):
        log_probs = logits_row.log_softmax(dim=-1)
        token_log_prob = torch.gather(log_probs, dim=1, index=input_ids_row.unsqueeze(1)).squeeze(1)
        per_token_logps.append(token_log_prob)
    return torch.stack(per_token_logps)


def ref_server_process(d):
    prompt_length = d['plen']
    with torch.inference_mode():
        per_token_logps = ref_get_per_token_logps(d['inputs'])
    per_token_logps = per_token_logps[:, prompt_length - 1:]
    out = dict(d)
    out['refs'] = per_token_logps.clone()
    return out


# ---- stand-ins for the vLLM worker
gen = torch.Generator().manual_seed(1)


@torch.no_grad()
def vllm_sample(prompt_ids, n):
    # SamplingParams(n=num_pre_Q, temperature=0.9, max_tokens=max_tokens): each answer sampled on its own,
    # ending at <|im_end|> (kept in token_ids) or at max_tokens
    outs = []
    for _ in range(n):
        ids = list(prompt_ids)
        ans = []
        for _ in range(max_tokens):
            logits = vllm_model(torch.tensor([ids])).logits[0, -1] / 0.9
            logits[[IM_START, ENDOFTEXT]] = float('-inf')
            logits[IM_END] += 1.5
            tok = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
            ans.append(tok)
            ids.append(tok)
            if tok == IM_END:
                break
        outs.append(ans)
    return outs


@torch.no_grad()
def vllm_prompt_logprobs(seqs, plen):
    # vllm_gen.generate(prompt_token_ids=merged_ids.tolist(), SamplingParams(max_tokens=1, prompt_logprobs=1)):
    # every list scored as its own prompt, [plen:] kept
    rows = []
    for s in seqs:
        x = torch.tensor([s])
        lp = vllm_model(x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
        rows.append(lp[plen - 1:])
    return torch.stack(rows)


def reward_fn(ans):
    body = [t for t in ans if t != IM_END]
    return float(sum(t % 2 == 0 for t in body)) / max(len(body), 1) + (0.5 if ans[-1] == IM_END else -0.5)


def chat_prompt(question):
    # apply_chat_template([system, user], add_generation_prompt=True)
    return ([IM_START, SYSTEM, 3, 4, 5, IM_END, IM_START, USER] + question + [IM_END, IM_START, ASSISTANT])


questions = [[int(t) for t in torch.randint(0, 26, (k,), generator=gen)] for k in (2, 5, 3)]
assert len(questions) == Q_batch_size

batches = []
for q in questions:
    prompt_ids = torch.tensor([chat_prompt(q)])
    plen = prompt_ids.shape[1]
    curr_ans_ids = vllm_sample(prompt_ids[0].tolist(), num_pre_Q)
    curr_rewards = torch.tensor([reward_fn(a) for a in curr_ans_ids], dtype=torch.float32)
    if curr_rewards.max() - curr_rewards.min() < 1e-4:
        continue
    curr_rewards = (curr_rewards - curr_rewards.mean()) / (curr_rewards.std() + 1e-4)
    for ii in range(0, num_pre_Q, train_batch_size):
        sub_rewards = curr_rewards[ii:ii + train_batch_size]
        sub_ans_ids = curr_ans_ids[ii:ii + train_batch_size]
        tensor_list = [torch.tensor(lst) for lst in sub_ans_ids]
        output_ids = pad_sequence(tensor_list, batch_first=True, padding_value=tokenizer.pad_token_id)
        Qrep = prompt_ids.repeat(1, output_ids.shape[0]).view(-1, plen)
        merged_ids = torch.cat([Qrep, output_ids], dim=1)
        data = {'plen': plen, 'inputs': merged_ids, 'rewards': sub_rewards}
        if compute_gen_logps:
            data['gen_logps'] = vllm_prompt_logprobs(merged_ids.tolist(), plen)
        batches.append((ref_server_process(data), sub_ans_ids, prompt_ids[0].tolist()))

lens = [len(a) for _, answers, _ in batches for a in answers]
assert len(set(lens)) > 2 and min(lens) < max(lens), lens
assert any(a[-1] == IM_END for _, answers, _ in batches for a in answers)


# ---- reference: every answer alone, unpadded, no mask
def row_logps(m, prompt, ans):
    x = torch.tensor([prompt + ans])
    lp = m(x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1:]


def reference_loss(batch, answers, prompt):
    losses = []
    adv = batch['rewards'].to(torch.float64)
    for i, ans in enumerate(answers):
        pol = row_logps(model, prompt, ans)
        with torch.no_grad():
            ref = row_logps(ref_model, prompt, ans)
            old = row_logps(vllm_model, prompt, ans)
        assert torch.allclose(ref, batch['refs'][i, :len(ans)], atol=1e-10)
        assert torch.allclose(old, batch['gen_logps'][i, :len(ans)], atol=1e-10)
        tok_losses = []
        for t in range(len(ans)):
            r = torch.exp(pol[t] - old[t])
            a = adv[i]
            surr = torch.min(r * a, torch.clamp(r, 1 - clip_param, 1 + clip_param) * a)
            d = ref[t] - pol[t]
            kl = torch.exp(d) - d - 1
            tok_losses.append(-(surr - beta * kl))
        losses.append(torch.stack(tok_losses).sum() / len(ans))
    return torch.stack(losses).mean(), pol


params = [p for p in model.parameters()]
for step, (batch, answers, prompt) in enumerate(batches):
    optimizer.zero_grad()
    loss, per_token_logps = GRPO_step(batch)
    ref_loss, _ = reference_loss(batch, answers, prompt)
    for i, ans in enumerate(answers):
        alone = row_logps(model, prompt, ans)
        assert torch.allclose(per_token_logps[i, :len(ans)], alone, atol=1e-10), (step, i)
    ref_grads = torch.autograd.grad(ref_loss, params)
    loss.backward()
    assert torch.allclose(loss, ref_loss, atol=1e-10), (step, loss.item(), ref_loss.item())
    for p, g in zip(params, ref_grads):
        assert torch.allclose(p.grad, g, atol=1e-9)
    optimizer.step()
    print(f"step {step}: plen={batch['plen']} L={batch['inputs'].shape[1]} loss={loss.item():.6f}")

print("ok:", len(batches), "micro-batches, answer lengths", sorted(lens))
sys.exit(0)
