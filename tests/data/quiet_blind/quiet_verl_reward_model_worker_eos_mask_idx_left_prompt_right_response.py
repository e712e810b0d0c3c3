# Citation: volcengine/verl verl/workers/fsdp_workers.py @b38119fa248231a6e1c6198d08c0a4e46354dd01
#   (RewardModelWorker._forward_micro_batch without use_remove_padding, _expand_to_token_level, compute_rm_score
#   without switching chat template or dynamic bsz); verl/utils/model.py (compute_position_id_with_mask);
#   verl/workers/rollout/vllm_rollout (the rollout's batch: left-padded prompts, responses padded to response_length,
#   response position ids continued from the prompt's last one, attention_mask = prompt mask + response mask).
# verl's model reward in a PPO step. The rollout batch is one row per sample: the prompt LEFT-padded to
# max_prompt_length, the response after it RIGHT-padded to response_length, attention_mask covering the real prompt
# tokens and the response up to its EOS, position_ids counted from the prompt's mask and running on (+1 per column)
# through the response, its padding included. RewardModelWorker splits the batch into micro batches, runs the token
# classification reward model (num_labels=1) on (input_ids, attention_mask, position_ids), and reads each row's score
# at `eos_mask_idx = argmax(position_ids * attention_mask)`, the last attended column; _expand_to_token_level puts that
# score at the same column of a zero (bsz, seqlen) tensor and keeps the last response_length columns (rm_scores).
# verl runs this under bf16 autocast on GPU; here it is float32 on CPU.
# Self-check: each sample run alone (its real prompt and response tokens, no padding, no mask, default positions):
# its score at its last token, and rm_scores holding it at response position (valid response length - 1), 0 elsewhere.
import torch
from transformers import Qwen2Config, Qwen2ForTokenClassification

torch.manual_seed(0)

PAD, EOS = 0, 1
VOCAB = 64
max_prompt_length, response_length = 7, 6
micro_batch_size_per_gpu = 2


# ---- verl/utils/model.py ----
def compute_position_id_with_mask(mask):
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0, max=None)


# ---- the rollout batch (verl/utils/torch_functional.py postprocess_data left_pad=True for prompts,
#      vllm_rollout.generate_sequences for responses) ----
def build_rollout_batch(prompts, responses):
    bsz = len(prompts)
    prompt_ids = torch.full((bsz, max_prompt_length), PAD, dtype=torch.long)
    prompt_mask = torch.zeros((bsz, max_prompt_length), dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, max_prompt_length - len(p):] = torch.tensor(p)
        prompt_mask[i, max_prompt_length - len(p):] = 1
    position_ids = compute_position_id_with_mask(prompt_mask)

    response = torch.full((bsz, response_length), PAD, dtype=torch.long)
    for i, r in enumerate(responses):
        response[i, : len(r)] = torch.tensor(r)
    seq = torch.cat([prompt_ids, response], dim=-1)

    delta_position_id = torch.arange(1, response_length + 1)
    delta_position_id = delta_position_id.unsqueeze(0).expand(bsz, -1)
    response_position_ids = position_ids[..., -1:] + delta_position_id
    position_ids = torch.cat([position_ids, response_position_ids], dim=-1)

    # get_response_mask(response_id=response, eos_token=EOS): 1 up to and including the first EOS
    is_eos = (response == EOS).long()
    response_attention_mask = (torch.cumsum(is_eos, dim=1) - is_eos).eq(0).long()
    attention_mask = torch.cat((prompt_mask, response_attention_mask), dim=-1)
    return {
        "prompts": prompt_ids,
        "responses": response,
        "input_ids": seq,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


# ---- verl/workers/fsdp_workers.py RewardModelWorker ----
class RewardModelWorker:
    def __init__(self, reward_module):
        self.reward_module = reward_module
        self.use_remove_padding = False

    def _forward_micro_batch(self, micro_batch):
        with torch.no_grad():
            input_ids = micro_batch["input_ids"]
            batch_size, seqlen = input_ids.shape
            attention_mask = micro_batch["attention_mask"]
            position_ids = micro_batch["position_ids"]

            output = self.reward_module(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            )
            rm_score = output.logits  # (batch_size, seq_len, 1)
            rm_score = rm_score.squeeze(-1)

            # extract the result of the last valid token
            eos_mask_idx = torch.argmax(position_ids * attention_mask, dim=-1)  # (bsz,)
            rm_score = rm_score[torch.arange(batch_size), eos_mask_idx]
            return rm_score

    def _expand_to_token_level(self, data, scores):
        batch_size = data["input_ids"].shape[0]
        # expand as token_level_reward
        attention_mask = data["attention_mask"]
        position_ids = data["position_ids"]
        response_length = data["responses"].shape[-1]
        eos_mask_idx = torch.argmax(position_ids * attention_mask, dim=-1)  # (bsz,)
        token_level_scores = torch.zeros_like(attention_mask, dtype=scores.dtype)  # (bsz, seqlen)
        token_level_scores[torch.arange(batch_size), eos_mask_idx] = scores

        # select the response part
        token_level_scores = token_level_scores[:, -response_length:]

        return token_level_scores

    def compute_rm_score(self, data):
        rm_inputs = {
            "input_ids": data["input_ids"],
            "attention_mask": data["attention_mask"],
            "position_ids": data["position_ids"],
        }
        keys = list(rm_inputs)
        micro_batches = [
            {k: rm_inputs[k][s : s + micro_batch_size_per_gpu] for k in keys}
            for s in range(0, rm_inputs["input_ids"].shape[0], micro_batch_size_per_gpu)
        ]
        output = []
        for micro_batch in micro_batches:
            rm_score = self._forward_micro_batch(micro_batch)
            output.append(rm_score)
        scores = torch.cat(output, dim=0)  # (batch_size)

        token_level_scores = self._expand_to_token_level(data, scores)
        return {"rm_scores": token_level_scores}, scores


config = Qwen2Config(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=PAD,
    eos_token_id=EOS,
    num_labels=1,
)
config._attn_implementation = "sdpa"
reward_module = Qwen2ForTokenClassification(config).eval()

g = torch.Generator().manual_seed(1)


def rand_tokens(n):
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


prompts = [rand_tokens(7), rand_tokens(3), rand_tokens(5), rand_tokens(2), rand_tokens(6)]
responses = [
    rand_tokens(3) + [EOS],          # stops early, right padding after
    rand_tokens(6),                  # hits response_length without EOS: every column attended
    rand_tokens(1) + [EOS],
    rand_tokens(5) + [EOS],          # EOS on the last column
    [EOS],                           # EOS only
]
data = build_rollout_batch(prompts, responses)
worker = RewardModelWorker(reward_module)
out, scores = worker.compute_rm_score(data)
rm_scores = out["rm_scores"]
assert rm_scores.shape == (len(prompts), response_length)

# ---- reference: each sample alone, unpadded ----
max_err = 0.0
for i, (p, r) in enumerate(zip(prompts, responses)):
    ids = torch.tensor([p + r])
    with torch.no_grad():
        ref = reward_module(input_ids=ids).logits[0, -1, 0]
    err = abs(scores[i].item() - ref.item())
    max_err = max(max_err, err)
    expected = torch.zeros(response_length)
    expected[len(r) - 1] = ref
    row_err = (rm_scores[i] - expected).abs().max().item()
    assert row_err < 1e-4, (i, row_err, rm_scores[i].tolist(), expected.tolist())
assert max_err < 1e-4, max_err

print(f"rm scores {scores.tolist()}")
print(f"max |score - per-sample last-token score| = {max_err:.2e}; rm_scores rows placed at their last response token")
