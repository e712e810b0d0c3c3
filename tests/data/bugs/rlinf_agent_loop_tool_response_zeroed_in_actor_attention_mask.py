# RLinf/RLinf commit 779c3188b ("feat: support search-r1 training", #478; the fix first proposed in RLinf/RLinf#318).
# In the multi-turn tool agent (RLinf/RLinf commit 418d8e479, #201), RolloutResult._get_attention_masks_and_position_ids
# built the response half of the actor's attention_mask from the agent loop's response_mask (1 for LLM tokens,
# 0 for tool-response tokens), so the FSDP actor's logprob forward hid every tool response from the tokens the
# policy generated after it. The fix keeps attention_mask = every valid prompt/response token and returns the
# tool-aware response_mask separately, for the loss and advantages only.
import sys

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- rlinf/data/datasets/utils.py ----
def batch_pad_to_fixed_len(batch, max_batch_len, pad_token, left_pad=False):
    if left_pad:
        batch_pad = torch.stack(
            [torch.cat([torch.full((max_batch_len - len(seq),), pad_token, dtype=seq.dtype), seq]) for seq in batch]
        )
    else:
        batch_pad = torch.stack(
            [torch.cat([seq, torch.full((max_batch_len - len(seq),), pad_token, dtype=seq.dtype)]) for seq in batch]
        )
    return batch_pad


# ---- a stand-in tokenizer with a Qwen-like chat template (ids only) ----
class ToyChatTokenizer:
    pad_token_id = 0
    im_start, im_end, nl = 1, 2, 3
    role_ids = {"system": 4, "user": 5, "assistant": 6, "tool": 7}

    def encode_text(self, text):
        return [10 + (sum(ord(c) for c in w) % 40) for w in text.split()]

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        ids = []
        for m in messages:
            ids += [self.im_start, self.role_ids[m["role"]], self.nl] + self.encode_text(m["content"]) + [self.im_end, self.nl]
        if add_generation_prompt:
            ids += [self.im_start, self.role_ids["assistant"], self.nl]
        return ids


# ---- rlinf/workers/agent/agent_loop.py + rlinf/agents/multiturn_demo/tool_agent_loop.py ----
class ToolAgentLoop:
    def __init__(self, tokenizer, max_prompt_len, max_resp_len, max_turns, turns_out):
        self.tokenizer = tokenizer
        self.max_prompt_len = max_prompt_len
        self.max_resp_len = max_resp_len
        self.max_turns = max_turns
        self.turns_out = turns_out  # what the rollout engine returns, turn by turn

    def generate(self, prompt_ids, turn, sampling_params):
        return {"output_ids": list(self.turns_out[turn])}

    def tool_call(self, turn):
        return {"text": f"result of search {turn} : paris is the capital of france"}

    def get_tool_response_ids(self, tool_messages):
        wo_messages = [{"role": "user", "content": "hi"}]
        wi_messages = [*wo_messages, *tool_messages]
        wo_ids = self.tokenizer.apply_chat_template(wo_messages, add_generation_prompt=False, tokenize=True)
        wi_ids = self.tokenizer.apply_chat_template(wi_messages, add_generation_prompt=True, tokenize=True)
        return wi_ids[len(wo_ids):]

    def run_one_query(self, prompt_ids):
        prompt_ids = prompt_ids[: self.max_prompt_len]
        orig_prompt_ids = list(prompt_ids)
        response_mask = []
        for turn in range(self.max_turns):
            max_resp_len = self.max_resp_len - (len(prompt_ids) - len(orig_prompt_ids))
            generate_result = self.generate(prompt_ids, turn, sampling_params={"max_new_tokens": max_resp_len})
            response_ids = generate_result["output_ids"]
            if len(response_ids) > max_resp_len:
                response_ids = response_ids[:max_resp_len]
            prompt_ids += response_ids
            response_mask += [1] * len(response_ids)  # 1 for LLM generated tokens
            if len(response_ids) == max_resp_len or turn == self.max_turns - 1:
                break

            tool_messages = [{"role": "tool", "content": self.tool_call(turn)["text"]}]
            tool_response_ids = self.get_tool_response_ids(tool_messages)
            max_tool_resp_len = self.max_resp_len - (len(prompt_ids) - len(orig_prompt_ids))
            if len(tool_response_ids) > max_tool_resp_len:
                break
            prompt_ids += tool_response_ids
            response_mask += [0] * len(tool_response_ids)  # 0 for tool response tokens

        response_ids = prompt_ids[len(orig_prompt_ids):]
        return dict(prompt_ids=orig_prompt_ids, response_ids=response_ids, response_mask=response_mask)


# ---- rlinf/data/io_struct.py (RolloutResult) ----
class RolloutResult:
    def __init__(self, prompt_ids, response_ids, response_mask):
        self.prompt_ids = prompt_ids
        self.response_ids = response_ids
        self.prompt_lengths = [len(p) for p in prompt_ids]
        self.response_lengths = [len(r) for r in response_ids]
        self.response_mask = response_mask

    if not FIXED:

        @staticmethod
        def _get_attention_masks_and_position_ids(prompt_lengths, response_lengths, response_mask, max_prompt_len, total_len):
            B = prompt_lengths.size(0)
            arange_ids = torch.arange(total_len).unsqueeze(0).expand(B, -1)
            prompt_start = max_prompt_len - prompt_lengths
            response_end = max_prompt_len + response_lengths
            prompt_start = prompt_start.unsqueeze(1)
            response_end = response_end.unsqueeze(1)
            if response_mask is not None:
                max_response_len = total_len - max_prompt_len
                response_mask = batch_pad_to_fixed_len(
                    [torch.as_tensor(ids, dtype=torch.long) for ids in response_mask],
                    max_batch_len=max_response_len,
                    pad_token=0,
                )
                attention_mask = torch.cat(
                    [
                        (torch.arange(max_prompt_len).unsqueeze(0).expand(response_mask.size(0), -1) >= prompt_start),
                        response_mask,
                    ],
                    dim=1,
                ).bool()
            else:
                attention_mask = (arange_ids >= prompt_start) & (arange_ids < response_end)

            position_ids = torch.zeros_like(arange_ids)
            for i in range(B):
                ps = prompt_start[i].item()
                position_ids[i, ps:] = torch.arange(total_len - ps)
            return attention_mask, position_ids

    else:

        @staticmethod
        def _get_attention_masks_and_position_ids(prompt_lengths, response_lengths, max_prompt_len, total_len):
            B = prompt_lengths.size(0)
            arange_ids = torch.arange(total_len).unsqueeze(0).expand(B, -1)
            prompt_start = max_prompt_len - prompt_lengths
            prompt_end = torch.full_like(prompt_start, max_prompt_len)
            response_end = max_prompt_len + response_lengths
            prompt_start = prompt_start.unsqueeze(1)
            prompt_end = prompt_end.unsqueeze(1)
            response_end = response_end.unsqueeze(1)
            attention_mask = (arange_ids >= prompt_start) & (arange_ids < response_end)
            response_mask = (arange_ids >= prompt_end) & (arange_ids < response_end)

            position_ids = torch.zeros_like(arange_ids)
            for i in range(B):
                ps = prompt_start[i].item()
                position_ids[i, ps:] = torch.arange(total_len - ps)
            return attention_mask, response_mask, position_ids

        @staticmethod
        def _get_response_masks(response_mask, max_prompt_len, total_len):
            return batch_pad_to_fixed_len(
                [torch.as_tensor([0] * max_prompt_len + ids, dtype=torch.long) for ids in response_mask],
                max_batch_len=total_len,
                pad_token=0,
            ).bool()

    def to_actor_batch(self, data_seq_length, training_seq_length, pad_token):
        max_response_len = training_seq_length - data_seq_length
        prompt_lengths = torch.tensor(self.prompt_lengths)
        response_lengths = torch.tensor(self.response_lengths)

        if not FIXED:
            attention_mask, position_ids = self._get_attention_masks_and_position_ids(
                prompt_lengths=prompt_lengths,
                response_lengths=response_lengths,
                response_mask=self.response_mask,
                max_prompt_len=data_seq_length,
                total_len=training_seq_length,
            )
        else:
            attention_mask, response_mask, position_ids = self._get_attention_masks_and_position_ids(
                prompt_lengths=prompt_lengths,
                response_lengths=response_lengths,
                max_prompt_len=data_seq_length,
                total_len=training_seq_length,
            )
            if self.response_mask is not None:
                response_mask = self._get_response_masks(self.response_mask, data_seq_length, training_seq_length)

        prompt_ids = batch_pad_to_fixed_len(
            [torch.as_tensor(ids, dtype=torch.long) for ids in self.prompt_ids],
            max_batch_len=data_seq_length, pad_token=pad_token, left_pad=True,
        )
        response_ids = batch_pad_to_fixed_len(
            [torch.as_tensor(ids, dtype=torch.long) for ids in self.response_ids],
            max_batch_len=max_response_len, pad_token=pad_token,
        )
        input_ids = torch.cat([prompt_ids, response_ids], dim=1)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "prompt_lengths": prompt_lengths,
            "response_lengths": response_lengths,
        }
        if FIXED:
            batch["response_mask"] = response_mask
        return batch


# ---- rlinf/utils/utils.py ----
def compute_logprobs_from_logits(logits, target):
    return torch.gather(torch.log_softmax(logits.float(), dim=-1), -1, target.unsqueeze(-1)).squeeze(-1)


# ---- rlinf/workers/actor/fsdp_actor_worker.py ----
class FSDPActor:
    def __init__(self, model, response_len, temperature):
        self.model = model
        self.response_len = response_len
        self.temperature = temperature

    @torch.no_grad()
    def inference_step(self, batch):
        self.model.eval()
        outputs = self.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        )
        logits = outputs.logits
        logits = logits[:, -self.response_len - 1 : -1, :]
        logits = logits / self.temperature
        responses = batch["input_ids"][:, -self.response_len :]
        return compute_logprobs_from_logits(logits, responses)

    def loss_mask(self, batch):
        if FIXED:
            return batch["response_mask"][:, -self.response_len :]
        return batch["attention_mask"][:, -self.response_len :]


def main():
    tok = ToyChatTokenizer()
    data_seq_length, training_seq_length = 16, 64
    response_len = training_seq_length - data_seq_length

    queries = [
        tok.apply_chat_template([{"role": "user", "content": "what is the capital of france"}], add_generation_prompt=True),
        tok.apply_chat_template([{"role": "user", "content": "who wrote hamlet"}], add_generation_prompt=True),
    ]
    rollouts = [
        [[51, 52, 53, 54, 55], [56, 57, 58, 2]],
        [[60, 61, 62], [63, 64, 65, 66, 2]],
    ]
    results = []
    for q, outs in zip(queries, rollouts):
        loop = ToolAgentLoop(tok, max_prompt_len=data_seq_length, max_resp_len=response_len, max_turns=2, turns_out=outs)
        results.append(loop.run_one_query(list(q)))

    rr = RolloutResult(
        prompt_ids=[r["prompt_ids"] for r in results],
        response_ids=[r["response_ids"] for r in results],
        response_mask=[r["response_mask"] for r in results],
    )
    batch = rr.to_actor_batch(data_seq_length, training_seq_length, pad_token=tok.pad_token_id)

    config = Qwen2Config(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config)
    actor = FSDPActor(model, response_len=response_len, temperature=1.0)

    logprobs = actor.inference_step(batch)
    loss_mask = actor.loss_mask(batch).float()
    for i in range(logprobs.size(0)):
        sel = loss_mask[i].bool()
        print(f"sample {i}: response tokens {int(sel.sum())}, logprobs", [round(v, 4) for v in logprobs[i][sel].tolist()])
    mean_logprob = (logprobs * loss_mask).sum() / loss_mask.sum()
    print("masked mean logprob:", round(mean_logprob.item(), 6))


if __name__ == "__main__":
    main()
