# ChatLearn, alibaba/ChatLearn commit f03ac94b ("[bugfix] fix position_ids and loss_mask computation"; PR #341),
# chatlearn/algorithm/grpo_utils/megatron_utils/train_helper.py get_batch (GRPO on Megatron-Core, packing enabled).
# The packed micro-batch is built by unpad_input + cu_seqlens (thd), labels = torch.roll(tokens, -1), and the per-token
# log-probs are padded back to [mbs, seq_length]. Before the fix:
#   * the per-sample loss mask marks [prompt_length, prompt_length + response_length) of the *tokens*, while the
#     log-prob at position t scores labels[t] = token t + 1: the first response token is never trained and the last
#     response position scores the first token of the next packed sample;
#   * position_ids[:, cu_seqlen:] -= cu_seqlen subtracts the cumulative offset, so the third packed sample onwards
#     starts at a negative position.
# The fix rolls the loss mask by -1 like the labels and subtracts only the previous sample's length.
# Megatron's GPTModel / TE thd attention is stood in for by a tiny Qwen2 model fed a block mask from cu_seqlens.
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- flash_attn.bert_padding (unpad_input / pad_input), CPU version ----
def index_first_axis(x, indices):
    return x.reshape(-1, *x.shape[2:])[indices]


def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = seqlens_in_batch
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return (index_first_axis(hidden_states, indices), indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch)


def pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros((batch * seqlen), *hidden_states.shape[1:], device=hidden_states.device,
                         dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])


class PackedSeqParams(SimpleNamespace):
    pass


args = SimpleNamespace(sequence_parallel=False)


def to_device(device, v):
    return v.to(device) if isinstance(v, torch.Tensor) else v


# ---- chatlearn/algorithm/grpo_utils/megatron_utils/train_helper.py ----
def get_batch(data_iter, is_training, is_packing=False):
    data_b = next(data_iter)

    tokens = data_b["all_tokens"].long()  # shape: [mbs, seq_length]
    mbs, seqlen = tokens.shape
    prompt_token_length = data_b["prompt_token_length"]
    response_token_length = data_b["response_token_length"]

    if is_packing:
        attn_mask_for_unpadding = torch.zeros_like(tokens, dtype=torch.int32)
        for i, (prompt_length, response_length) in enumerate(zip(prompt_token_length, response_token_length)):
            attn_mask_for_unpadding[i, : prompt_length + response_length] = 1
        (tokens, indices, cu_seqlens, max_seqlen_in_batch, *_) = unpad_input(tokens.unsqueeze(-1),
                                                                             attn_mask_for_unpadding)
        tokens = tokens.transpose(0, 1)  # [s, b] -> [b, s]
        pad_size = 0

        labels = torch.roll(tokens, shifts=-1, dims=1)

        position_ids = torch.arange(tokens.shape[1], device=tokens.device).view(1, -1)
        if FIXED:
            prev_cu_seqlen = 0
            for cu_seqlen in cu_seqlens[1:]:
                position_ids[:, cu_seqlen:] -= cu_seqlen - prev_cu_seqlen
                prev_cu_seqlen = cu_seqlen
        else:
            for cu_seqlen in cu_seqlens[1:]:
                position_ids[:, cu_seqlen:] -= cu_seqlen

        packed_seq_params = PackedSeqParams(
            qkv_format='thd',
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=max_seqlen_in_batch,
            max_seqlen_kv=max_seqlen_in_batch
        )

        input_data = {
            "all_tokens": tokens,
            "all_token_attention_mask": None,
            "all_token_position_ids": position_ids,
            "labels": labels,
            'packed_seq_params': packed_seq_params,
            "ori_seq_len": seqlen,
            "ori_batch_size": mbs,
            "indices": indices,
            "pad_size": pad_size,
        }

    if is_training:
        ref_logprobs = data_b["ref_logprobs"].float()
        old_logprobs = data_b["old_logprobs"].float()
        advantages = data_b["advantages"]

        loss_mask = torch.zeros_like(data_b["all_tokens"], dtype=torch.int32)
        for i, (prompt_length, response_length) in enumerate(zip(prompt_token_length, response_token_length)):
            loss_mask[i, prompt_length: prompt_length + response_length] = 1
        if FIXED:
            loss_mask = torch.roll(loss_mask, shifts=-1, dims=1)

        input_data.update({
            "all_token_loss_mask": loss_mask,
            "advantages": advantages,
            "ref_logprobs": ref_logprobs,
            "old_logprobs": old_logprobs,
        })

    for k, v in input_data.items():
        input_data[k] = to_device("cpu", v)
    return input_data


def loss_func(inputs, losses):
    require_bp_keys = ['pg_loss']

    loss_mask = inputs["all_token_loss_mask"].float()
    total_loss_for_bp = 0
    reporting_losses = {}
    for key, loss in losses.items():
        if key not in require_bp_keys:
            loss = loss.detach()
        if key.endswith('_sample_average'):
            final_loss = (loss.float() * loss_mask).sum() / (1e-5 + loss_mask.sum())
        else:
            final_loss = (loss.float() * loss_mask).sum()
        if key in require_bp_keys:
            total_loss_for_bp = total_loss_for_bp + final_loss

        reporting_losses[key] = final_loss.detach().clone().to(torch.float)

    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting_losses["num_tokens"] = num_tokens
    reporting_losses["num_samples"] = torch.ones_like(num_tokens)
    return total_loss_for_bp, num_tokens, reporting_losses


def entropy_from_tensor_parallel_logits(logits):
    vocab_parallel_logits = logits.float()
    logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
    vocab_parallel_logits = vocab_parallel_logits - logits_max.unsqueeze(-1)
    exp_logits = vocab_parallel_logits.exp()
    sum_exp_logits = exp_logits.sum(dim=-1)
    softmax_times_logits = (exp_logits / sum_exp_logits.unsqueeze(-1) * logits.float()).sum(dim=-1)
    return logits_max + sum_exp_logits.log() - softmax_times_logits


# ---- chatlearn/algorithm/grpo_utils/loss_gallery.py ----
def calculate_grpo_loss(log_probs, old_log_probs, advantages, diff_clip_ratio=10, pos_clip_ratio=0.2,
                        neg_clip_ratio=0.2, final_clip_ratio=0.01):
    logprobs_diff = log_probs - old_log_probs
    # clip logprobs_diff before exp to avoid overflow
    logprobs_diff = torch.clamp(logprobs_diff, max=diff_clip_ratio)

    ratio = torch.exp(logprobs_diff)
    pg_loss = -advantages.unsqueeze(-1) * ratio
    # Upper and lower bound clip
    pg_loss_2 = -advantages.unsqueeze(-1) * torch.clamp(ratio, 1 - neg_clip_ratio, 1 + pos_clip_ratio)
    pg_loss_clip = torch.max(pg_loss, pg_loss_2)
    pg_loss_upperbound = torch.ones_like(pg_loss) * final_clip_ratio
    # final clip on loss
    loss = torch.min(pg_loss_clip, pg_loss_upperbound)
    return loss.contiguous()


# ---- chatlearn/algorithm/grpo_utils/megatron_utils/policy_model.py (GPTModel stood in by Qwen2) ----
class PolicyModel(nn.Module):
    def __init__(self, config, module_args):
        super().__init__()
        self.lm = Qwen2ForCausalLM(config)
        self.module_args = module_args
        self.post_process = True

    def _thd_attention_mask(self, packed_seq_params, total):
        # What TE's thd kernel does with cu_seqlens: causal attention inside each packed sample only.
        seq_id = torch.zeros(total, dtype=torch.long)
        for cu in packed_seq_params.cu_seqlens_q[1:-1]:
            seq_id[cu:] += 1
        causal = torch.ones(total, total, dtype=torch.bool).tril()
        return (causal & (seq_id[:, None] == seq_id[None, :]))[None, None]

    def compute_language_model_loss(self, labels, logits):
        # logits [s, b, v], labels [b, s] -> loss [b, s]
        labels = labels.transpose(0, 1).contiguous()
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        return loss.view_as(labels).transpose(0, 1).contiguous()

    def forward(self, input_ids, position_ids, attention_mask, labels=None, training_inputs=None,
                packed_seq_params=None):
        if packed_seq_params is not None:
            attention_mask = self._thd_attention_mask(packed_seq_params, input_ids.shape[1])
        hidden_states_or_logits = self.lm(input_ids=input_ids, position_ids=position_ids,
                                          attention_mask=attention_mask).logits

        if training_inputs is None:
            return self.compute_language_model_loss(labels, hidden_states_or_logits.transpose(0, 1).contiguous())

        return self._compute_all_losses(
            all_token_logits=hidden_states_or_logits.transpose(0, 1).contiguous(),
            labels=labels,
            training_inputs=training_inputs
        )

    def _compute_all_losses(self, all_token_logits, labels, training_inputs):
        forward_logprob = (self.compute_language_model_loss(labels, all_token_logits) * -1)

        # NOTE: before loss computation, we need to unpack the packed inputs
        if self.module_args.packing:
            forward_logprob = pad_input(
                forward_logprob[0, :forward_logprob.shape[1] - training_inputs['pad_size']].unsqueeze(-1),
                training_inputs['indices'],
                training_inputs['ori_batch_size'],
                training_inputs['ori_seq_len']
            ).squeeze(-1)

        old_logprobs = training_inputs["old_logprobs"]
        ref_logprobs = training_inputs["ref_logprobs"]
        advantages = training_inputs["advantages"]

        pg_loss = calculate_grpo_loss(
            log_probs=forward_logprob,
            old_log_probs=old_logprobs,
            advantages=advantages,
            diff_clip_ratio=self.module_args.diff_clip_ratio,
            pos_clip_ratio=self.module_args.pos_clip_ratio,
            neg_clip_ratio=self.module_args.neg_clip_ratio,
            final_clip_ratio=self.module_args.final_clip_ratio
        )
        entropy_loss = entropy_from_tensor_parallel_logits(all_token_logits)
        if self.module_args.packing:
            entropy_loss = pad_input(
                entropy_loss[:entropy_loss.shape[0] - training_inputs['pad_size']],
                training_inputs['indices'],
                training_inputs['ori_batch_size'],
                training_inputs['ori_seq_len']
            ).squeeze(-1)

        kl = ref_logprobs - forward_logprob
        ratio = torch.exp(kl)
        ratio[~training_inputs['all_token_loss_mask'].bool()] = 1
        kld = (ratio - kl - 1).contiguous()
        kl_loss = torch.clamp(kld, min=-10, max=10)

        return {'pg_loss': pg_loss, 'entropy_loss': entropy_loss, 'kl_loss': kl_loss}


def forward_step(data_iterator, model, *, is_training=False, is_packing=False):
    inputs = get_batch(data_iterator, is_training=is_training, is_packing=is_packing)
    output_tensor = model(
        input_ids=inputs["all_tokens"],
        position_ids=inputs["all_token_position_ids"],
        attention_mask=inputs["all_token_attention_mask"],
        labels=inputs["labels"],
        training_inputs=inputs if is_training else None,
        packed_seq_params=inputs['packed_seq_params'] if is_packing else None
    )
    if is_training:
        return loss_func(inputs, output_tensor)
    if model.post_process and is_packing:
        output_tensor = pad_input(
            output_tensor[0, :output_tensor.shape[1] - inputs['pad_size']].unsqueeze(-1),
            inputs['indices'],
            inputs['ori_batch_size'],
            inputs['ori_seq_len']
        ).squeeze(-1)
    return output_tensor


module_args = SimpleNamespace(packing=True, pos_clip_ratio=0.2, neg_clip_ratio=0.2, diff_clip_ratio=10,
                              final_clip_ratio=3)
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     attn_implementation="sdpa")
policy = PolicyModel(config, module_args)
torch.manual_seed(1)
reference = PolicyModel(config, module_args).eval()

# One micro-batch of three rollouts, right-padded to seq_length = 12 (pad id 0).
prompt_token_length = torch.tensor([3, 4, 2])
response_token_length = torch.tensor([5, 3, 6])
g = torch.Generator().manual_seed(7)
all_tokens = torch.zeros(3, 12, dtype=torch.long)
for i in range(3):
    n = int(prompt_token_length[i] + response_token_length[i])
    all_tokens[i, :n] = torch.randint(1, 64, (n,), generator=g)
data = {"all_tokens": all_tokens, "prompt_token_length": prompt_token_length,
        "response_token_length": response_token_length}

# forward_step of the policy trainer / reference: old_logprobs and ref_logprobs.
with torch.no_grad():
    policy.eval()
    data["old_logprobs"] = -forward_step(iter([data]), policy, is_training=False, is_packing=True)
    data["ref_logprobs"] = -forward_step(iter([data]), reference, is_training=False, is_packing=True)
    policy.train()
data["advantages"] = torch.tensor([1.0, -0.5, -0.5])

loss, num_tokens, reporting = forward_step(iter([data]), policy, is_training=True, is_packing=True)
loss.backward()
grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in policy.parameters() if p.grad is not None))

for k, v in reporting.items():
    print(f"{k}: {float(v):.6f}")
print(f"grad_norm: {grad_norm.item():.6f}")
