"""NeMo-Aligner DPO batch: right padding with EOS, causal-only boolean mask (correct program).

Port, shrunk to toy sizes, of NVIDIA/NeMo-Aligner:
  nemo_aligner/data/nlp/datasets.py @01a6091cef96a4410e8c63a326c0ab45009d5400
      DPOModelDataset.__getitem__: prompt+response, append_eod, pad chosen/rejected to
      the longer of the two with eos_id, labels -100 on the prompt and on padding
  nemo_aligner/algorithms/dpo.py: dpo_custom_collate
      pad_sequence(..., padding_value=eos_id) over the batch, then
      get_ltor_masks_and_position_ids(chosen_tokens, eos_id, False, False, False);
      the (1,1,S,S) mask is repeated over the batch
  nemo_aligner/models/nlp/gpt/megatron_gpt_dpo_model.py
      tokens = cat(chosen, rejected); attention_mask[0:1]; per-token log-probs from the
      logits against the (rolled) labels; get_reduced_masked_logps keeps labels > -1
  NVIDIA/NeMo nemo/collections/nlp/modules/common/megatron/utils.py
      get_ltor_masks_and_position_ids: tril ones, then `attention_mask < 0.5`
      -> boolean mask where True means "masked"; Megatron's attention_mask_func fills
      masked scores with the finite value -10000.0 before the softmax.

There is no padding mask at all: the padding is on the right, so the causal mask
already keeps every real token from seeing the EOS padding after it; pad positions
attend to real tokens and to each other, but their labels are -100 and their
log-probs are dropped by the loss mask.  The mask is built from the chosen tokens
and reused for the rejected half, which is right because with
reset_attention_mask=False it does not depend on the tokens.

Reference: every sequence alone, unpadded, attention as an explicit loop over
positions (query i sums over keys 0..i), no mask tensor.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)

VOCAB = 23
EOS_ID = 2
HIDDEN = 16
HEADS = 2
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2
MAX_POS = 32
BETA = 0.1  # ref_policy_kl_penalty


# ---- NeMo megatron utils ----
def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    micro_batch_size, seq_length = data.size()
    att_mask_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_mask_batch, seq_length, seq_length), device=data.device)).view(
        att_mask_batch, 1, seq_length, seq_length
    )
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    position_ids = position_ids.unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod_token]
            if reset_position_ids:
                eod_index = eod_index.clone()
            prev_index = 0
            for j in range(eod_index.size()[0]):
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1):, : (i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1):] -= i + 1 - prev_index
                    prev_index = i + 1
    # Convert attention mask to binary:
    attention_mask = attention_mask < 0.5
    return attention_mask, loss_mask, position_ids


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


# ---- tiny Megatron-style GPT ----
class ParallelAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query_key_value = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.norm_factor = math.sqrt(HEAD_DIM)

    def split(self, x):
        b, s, _ = x.shape
        q, k, v = self.query_key_value(x).view(b, s, HEADS, 3 * HEAD_DIM).split(HEAD_DIM, dim=-1)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, attention_mask):
        b, s, _ = x.shape
        q, k, v = self.split(x)
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.norm_factor  # (b, h, s, s)
        # FusedScaleMaskSoftmax, unfused path: mask_func then softmax
        probs = torch.softmax(attention_mask_func(scores, attention_mask), dim=-1)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, HIDDEN)
        return self.dense(ctx)


class TransformerLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attention = ParallelAttention()
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x, attention_mask):
        x = x + self.self_attention(self.input_layernorm(x), attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class GPTModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(MAX_POS, HIDDEN)
        self.layers = nn.ModuleList([TransformerLayer() for _ in range(LAYERS)])
        self.final_layernorm = nn.LayerNorm(HIDDEN)

    def forward(self, input_ids, position_ids, attention_mask):
        h = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask)
        h = self.final_layernorm(h)
        return h @ self.word_embeddings.weight.t()  # tied output layer


def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, higher_stability=True):
    """Single-partition stand-in for nemo_aligner.utils.distributed: labels rolled left,
    out-of-vocab targets (-100) give log-prob 0, last column dropped."""
    target = target.roll(shifts=-1, dims=-1)
    log_probs = torch.log_softmax(vocab_parallel_logits.float(), dim=-1)
    target_mask = (target < 0) | (target >= VOCAB)
    masked_target = target.clone()
    masked_target[target_mask] = 0
    lp = log_probs.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1)
    lp = lp.masked_fill(target_mask, 0.0)
    return lp[:, :-1].contiguous()


# ---- data: DPOModelDataset.__getitem__ and dpo_custom_collate ----
def dataset_item(prompt, chosen_resp, rejected_resp, append_eod=True):
    prompt_len = len(prompt)
    chosen = prompt + chosen_resp + ([EOS_ID] if append_eod else [])
    reject = prompt + rejected_resp + ([EOS_ID] if append_eod else [])
    chosen_len, reject_len = len(chosen), len(reject)
    chosen_labels = [-100] * prompt_len + chosen[prompt_len:]
    reject_labels = [-100] * prompt_len + reject[prompt_len:]
    max_curr_seq_len = max(chosen_len, reject_len)
    pad = lambda t, v: F.pad(torch.LongTensor(t), (0, max_curr_seq_len - len(t)), mode="constant", value=v)
    return {
        "chosen": pad(chosen, EOS_ID), "rejected": pad(reject, EOS_ID),
        "chosen_length": chosen_len, "rejected_length": reject_len,
        "chosen_labels": pad(chosen_labels, -100), "rejected_labels": pad(reject_labels, -100),
        "_raw": (chosen, reject, chosen_labels, reject_labels),
    }


def dpo_custom_collate(batch, eos_id, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False):
    chosen_tokens = torch.nn.utils.rnn.pad_sequence([it["chosen"] for it in batch], batch_first=True, padding_value=eos_id)
    rejected_tokens = torch.nn.utils.rnn.pad_sequence([it["rejected"] for it in batch], batch_first=True, padding_value=eos_id)
    chosen_labels = torch.nn.utils.rnn.pad_sequence([it["chosen_labels"] for it in batch], batch_first=True, padding_value=-100)
    rejected_labels = torch.nn.utils.rnn.pad_sequence([it["rejected_labels"] for it in batch], batch_first=True, padding_value=-100)
    attention_mask, _, position_ids = get_ltor_masks_and_position_ids(
        chosen_tokens, eos_id, reset_position_ids, reset_attention_mask, eod_mask_loss
    )
    assert attention_mask.ndim == 4
    if attention_mask.shape[0] == 1:
        attention_mask = attention_mask.repeat(len(batch), *((1,) * (len(attention_mask.shape) - 1)))
    return {
        "chosen": chosen_tokens, "rejected": rejected_tokens,
        "chosen_labels": chosen_labels, "rejected_labels": rejected_labels,
        "attention_mask": attention_mask, "position_ids": position_ids,
    }


def get_reduced_masked_logps(logps, labels, average_log_probs=False):
    loss_mask = (labels > -1).float()
    if average_log_probs:
        return (logps * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1)
    return (logps * loss_mask).sum(-1)


@torch.no_grad()
def batched_logprobs(model, batch):
    """get_ref_policy_logprobs / fwd_output_and_loss_func, pipeline size 1."""
    tokens = torch.cat((batch["chosen"], batch["rejected"]), dim=0)
    labels = torch.cat((batch["chosen_labels"], batch["rejected_labels"]), dim=0)
    pos_ids = torch.cat((batch["position_ids"], batch["position_ids"]), dim=0)
    attention_mask = batch["attention_mask"][0:1]
    logits = model(tokens, pos_ids, attention_mask)
    return from_parallel_logits_to_logprobs(logits, labels), labels


def dpo_loss(pi_logprobs, ref_logprobs, labels):
    rewards = get_reduced_masked_logps(pi_logprobs - ref_logprobs, labels[:, 1:])
    chosen_rewards, reject_rewards = torch.split(BETA * rewards, len(rewards) // 2, dim=0)
    return -F.logsigmoid(chosen_rewards - reject_rewards), rewards


# ---- independent reference ----
@torch.no_grad()
def reference_seq_logprob(model, tokens, labels):
    """Sum of log p(token_t | tokens_<t) over response positions, one unpadded sequence."""
    ids = torch.tensor(tokens).view(1, -1)
    L = ids.shape[1]
    h = model.word_embeddings(ids) + model.position_embeddings(torch.arange(L).view(1, L))
    for layer in model.layers:
        attn = layer.self_attention
        q, k, v = attn.split(layer.input_layernorm(h))
        ctx = torch.zeros(1, HEADS, L, HEAD_DIM)
        for i in range(L):
            s = q[:, :, i:i + 1] @ k[:, :, : i + 1].transpose(-1, -2) / attn.norm_factor
            ctx[:, :, i] = (torch.softmax(s, dim=-1) @ v[:, :, : i + 1])[:, :, 0]
        h = h + attn.dense(ctx.transpose(1, 2).reshape(1, L, HIDDEN))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = model.final_layernorm(h) @ model.word_embeddings.weight.t()
    lp = torch.log_softmax(logits[0], dim=-1)
    total = 0.0
    for t in range(1, L):
        if labels[t] != -100:
            total = total + lp[t - 1, tokens[t]]
    return total


def main():
    policy = GPTModel().eval()
    ref_policy = GPTModel().eval()  # a different set of weights for the reference policy
    samples = [
        ([5, 6, 7], [8, 9, 10, 11], [12, 13]),
        ([4, 14, 15, 16, 17], [18], [19, 20, 21, 22, 3, 9]),
        ([7, 7], [10, 3], [11, 12, 13]),
    ]
    items = [dataset_item(*s) for s in samples]
    batch = dpo_custom_collate(items, EOS_ID)
    assert batch["attention_mask"].dtype == torch.bool

    pi_lp, labels = batched_logprobs(policy, batch)
    ref_lp, _ = batched_logprobs(ref_policy, batch)
    loss, rewards = dpo_loss(pi_lp, ref_lp, labels)

    # reference: each chosen / rejected sequence alone, no padding
    B = len(items)
    ref_rewards = torch.zeros(2 * B)
    for b, it in enumerate(items):
        chosen, reject, chosen_labels, reject_labels = it["_raw"]
        for half, (toks, labs) in enumerate([(chosen, chosen_labels), (reject, reject_labels)]):
            ref_rewards[half * B + b] = (
                reference_seq_logprob(policy, toks, labs) - reference_seq_logprob(ref_policy, toks, labs)
            )
    ref_chosen, ref_reject = torch.split(BETA * ref_rewards, B)
    ref_loss = -F.logsigmoid(ref_chosen - ref_reject)

    d_rew = (rewards - ref_rewards).abs().max().item()
    d_loss = (loss - ref_loss).abs().max().item()
    print(f"padded batch shape {tuple(batch['chosen'].shape)}, mask {tuple(batch['attention_mask'].shape)} bool")
    print(f"max |reward diff| = {d_rew:.2e}, max |loss diff| = {d_loss:.2e}, loss = {loss.tolist()}")
    ok = d_rew < 1e-4 and d_loss < 1e-5
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
