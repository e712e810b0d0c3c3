# Citation: PrimeIntellect-ai/prime-rl @7a9dcd3e969bb4e91f2c4d3e3a7603cb32a01474 ("add sequence packing (#185)"):
#   src/zeroband/training/data.py (collate_fn, pack_datatset_outputs_efficiently, packed_batch_packing,
#   packed_batch_padding, merge_batches_padding, pack_datatset_outputs_balancing, packed_batch_balancing,
#   data_parallel_rebalancing, packed_batch; the ParquetDataset row -> input_ids / loss_mask / advantages),
#   src/zeroband/train.py (the no-grad logprob pass over all micro-batches of step_per_rollout rollouts, then
#   model(input_ids=input_ids, position_ids=batch["position_ids"]) -> grpo_loss - entropy_loss_coeff * entropy),
#   src/zeroband/training/loss.py (grpo_loss, selective_log_softmax, entropy_loss, _apply_mask),
#   src/zeroband/models.py (get_model_and_tokenizer: attn_implementation from the config, use_cache = False,
#   pad = eos).
# GRPO training on rollouts packed without any attention mask: samples (prompt + completion, loss_mask 0 on the
# prompt) are binned first-fit-decreasing into rows of seq_length * micro_bs tokens; each sample's position_ids
# restart at 0 and the tail padding gets its own arange(0, padding_len), so the row's document boundaries live
# only in position_ids. "padding" / "balancing" modes instead pad each sample to its own row, again with the pad
# positions restarting at 0. The model is a tiny Qwen2 (Qwen2Config) with attn_implementation="sdpa" (one of the
# repo's AttnImpl choices; its configs ran flash_attention_2, which reads the boundaries from position_ids) and
# use_cache=False, under transformers 5, whose sdpa mask builder turns reset position_ids into a block-causal
# mask when no attention_mask and no cache are given.
# Checked against each sample run alone, unpadded, with default positions and no mask: the recomputed logprobs
# of every sample token, then two optimizer steps (step_per_rollout=2, the second one off-policy so the ratio is
# not 1) whose losses, gradients and updated weights match a mirror model trained on the unpacked samples.
from copy import deepcopy
from typing import Literal, TypeAlias

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

PAD = 0  # tokenizer.pad_token_id = tokenizer.eos_token_id


# ---- src/zeroband/training/data.py
def collate_fn(samples, max_seq_len: int, pad_token_id: int):
    """
    This take a list of samples that should be packed together along the sequence dimension. Will add padding at
    the end of needed and clipped to max_seq_len
    """
    total_len = sum(len(sample["input_ids"]) for sample in samples)

    inputs_ids = [sample["input_ids"] for sample in samples]
    advantages = [sample["advantages"] for sample in samples]
    rewards = [sample["rewards"] for sample in samples]
    loss_masks = [sample["loss_mask"] for sample in samples]
    logprobs = [sample["logprobs"] for sample in samples]

    seq_lens = [len(sample["input_ids"]) for sample in samples]
    position_ids = [torch.arange(0, len(sample["input_ids"]), dtype=torch.int32) for sample in samples]

    if total_len < max_seq_len:
        padding_len = max_seq_len - total_len

        inputs_ids.append(torch.full((padding_len,), fill_value=pad_token_id, dtype=inputs_ids[0].dtype))
        advantages.append(torch.zeros(padding_len, dtype=advantages[0].dtype))
        loss_masks.append(torch.zeros(padding_len, dtype=loss_masks[0].dtype).int())
        logprobs.append(torch.zeros(padding_len, dtype=logprobs[0].dtype))
        position_ids.append(torch.arange(0, padding_len, dtype=torch.int32))

    return {
        # token level
        "input_ids": torch.cat(inputs_ids, dim=0)[:max_seq_len].unsqueeze(0),
        "advantages": torch.cat(advantages, dim=0)[:max_seq_len].unsqueeze(0),
        "loss_mask": torch.cat(loss_masks, dim=0)[:max_seq_len].unsqueeze(0),
        "logprobs": torch.cat(logprobs, dim=0)[:max_seq_len].unsqueeze(0),
        "position_ids": torch.cat(position_ids, dim=0)[:max_seq_len].unsqueeze(0),
        # sample level
        "rewards": torch.tensor(rewards),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
    }


def pack_datatset_outputs_efficiently(batch_optim, max_seq_len: int):
    batch_with_len = [(len(sample["input_ids"]), sample) for sample in batch_optim]
    sorted_batch = sorted(batch_with_len, key=lambda x: x[0], reverse=True)

    batches = []
    for seq_len, sample in sorted_batch:
        bin_found = False
        for bin_idx, bin_content in enumerate(batches):
            bin_len = sum(len(s["input_ids"]) for s in bin_content)
            if bin_len + seq_len <= max_seq_len:
                batches[bin_idx].append(sample)
                bin_found = True
                break
        if not bin_found:
            batches.append([sample])
    return batches


def data_parallel_rebalancing(micro_batches):
    num_grad_acc_steps = len(micro_batches)
    max_grad_acc_step = num_grad_acc_steps
    if dist.is_initialized():
        max_grad_acc_step = torch.tensor(num_grad_acc_steps, dtype=torch.int32)
        dist.all_reduce(max_grad_acc_step, op=dist.ReduceOp.MAX, group=None)
        max_grad_acc_step = int(max_grad_acc_step.item())

    empty_batch_count = max_grad_acc_step - num_grad_acc_steps
    for _ in range(empty_batch_count):
        empty_batch = {}
        for key, value in micro_batches[0].items():
            if isinstance(value, torch.Tensor):
                empty_batch[key] = value.clone()
            else:
                empty_batch[key] = value
        micro_batches.append(empty_batch)
    return micro_batches


def packed_batch_packing(batch_optim, max_seq_len: int, pad_token_id: int, micro_bs: int):
    """
    this function will pack the batch into [1, seq_len] microbatch tensors with positions ids for calling fa2 with
    sequence packing
    """
    max_seq_len = max_seq_len * micro_bs
    batches = pack_datatset_outputs_efficiently(batch_optim, max_seq_len=max_seq_len)
    micro_batches = [collate_fn(bin, pad_token_id=pad_token_id, max_seq_len=max_seq_len) for bin in batches]
    return data_parallel_rebalancing(micro_batches)


def merge_batches_padding(batches):
    return {
        "input_ids": torch.cat([b["input_ids"] for b in batches], dim=0),
        "advantages": torch.cat([b["advantages"] for b in batches], dim=0),
        "rewards": torch.cat([b["rewards"] for b in batches], dim=0),
        "loss_mask": torch.cat([b["loss_mask"] for b in batches], dim=0),
        "logprobs": torch.cat([b["logprobs"] for b in batches], dim=0),
        "position_ids": torch.cat([b["position_ids"] for b in batches], dim=0),
        "seq_lens": torch.cat([b["seq_lens"] for b in batches]),
    }


def packed_batch_padding(batch_optim, max_seq_len: int, pad_token_id: int, micro_bs: int):
    assert len(batch_optim) % micro_bs == 0, "batch_optim must be divisible by micro_bs"
    sample_padded_batch = [collate_fn([sample_batch], max_seq_len, pad_token_id) for sample_batch in batch_optim]
    micro_batches = [merge_batches_padding(sample_padded_batch[i: i + micro_bs])
                     for i in range(0, len(sample_padded_batch), micro_bs)]
    return micro_batches


def pack_datatset_outputs_balancing(batch_optim, max_seq_len: int, micro_bs: int):
    max_token_per_micro_batch = max_seq_len * micro_bs
    batch_with_len = [(len(sample["input_ids"]), sample) for sample in batch_optim]
    sorted_batch = sorted(batch_with_len, key=lambda x: x[0])

    batches_and_max_seq_len = []
    micro_batch = []
    max_seq_len_current_batch = 0
    for seq_len, sample in sorted_batch:
        maybe_max_seq_len = max(max_seq_len_current_batch, seq_len)
        if maybe_max_seq_len * (len(micro_batch) + 1) > max_token_per_micro_batch:
            batches_and_max_seq_len.append((micro_batch, maybe_max_seq_len))
            micro_batch = [sample]
            max_seq_len_current_batch = seq_len
        else:
            max_seq_len_current_batch = maybe_max_seq_len
            micro_batch.append(sample)
    batches_and_max_seq_len.append((micro_batch, max_seq_len_current_batch))
    return batches_and_max_seq_len


def packed_batch_balancing(batch_optim, max_seq_len: int, pad_token_id: int, micro_bs: int):
    batches_and_max_seq_len = pack_datatset_outputs_balancing(batch_optim, max_seq_len, micro_bs)
    micro_batches = []
    for batch, max_seq_len_batch in batches_and_max_seq_len:
        padded_micro_batch = []
        for sample in batch:
            collate_sample = collate_fn([sample], max_seq_len_batch, pad_token_id)
            padded_micro_batch.append(collate_sample)
        micro_batch = merge_batches_padding(padded_micro_batch)
        micro_batches.append(micro_batch)
    return data_parallel_rebalancing(micro_batches)


CollateMode: TypeAlias = Literal["packing", "padding", "balancing"]


def packed_batch(batch_optim, max_seq_len: int, pad_token_id: int, micro_bs: int, collate_mode: CollateMode):
    match collate_mode:
        case "packing":
            return packed_batch_packing(batch_optim, max_seq_len, pad_token_id, micro_bs)
        case "padding":
            return packed_batch_padding(batch_optim, max_seq_len, pad_token_id, micro_bs)
        case "balancing":
            return packed_batch_balancing(batch_optim, max_seq_len, pad_token_id, micro_bs)
        case _:
            raise ValueError(f"Invalid collate mode: {collate_mode}")


# ---- src/zeroband/training/loss.py
def selective_log_softmax(logits, index):
    if logits.dtype in [torch.float32, torch.float64]:
        selected_logits = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        per_token_logps = selected_logits - logsumexp_values  # log_softmax(x_i) = x_i - logsumexp(x)
    else:
        per_token_logps = []
        for row_logits, row_labels in zip(logits, index):
            row_logps = F.log_softmax(row_logits, dim=-1)
            row_per_token_logps = row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1)
            per_token_logps.append(row_per_token_logps)
        per_token_logps = torch.stack(per_token_logps)
    return per_token_logps


def grpo_loss(logits, input_ids, advantages, original_logprobs, loss_mask, temperature, epsilon_low, epsilon_high,
              masked_mean_axis):
    # we start by dropping the bos token because it does not have a corresponding logit
    input_ids = input_ids[:, 1:]
    advantages = advantages[:, 1:]
    loss_mask = loss_mask[:, 1:]

    # from the logits we drop the last logits because it corresponds to the next token that will be sample
    logits = logits[:, :-1, :]
    logits = logits / temperature
    per_token_logps = selective_log_softmax(logits, input_ids)

    coef_1 = torch.exp(per_token_logps - original_logprobs)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss1 = -coef_1 * advantages
    per_token_loss2 = -coef_2 * advantages
    per_token_loss = torch.max(per_token_loss1, per_token_loss2)

    loss = _apply_mask(per_token_loss, loss_mask, masked_mean_axis)

    is_clipped = (per_token_loss1 < per_token_loss2).float()
    clip_ratio = _apply_mask(is_clipped, loss_mask, masked_mean_axis)
    return loss, clip_ratio


def entropy_loss(logits, loss_mask, temperature, masked_mean_axis):
    logits = logits[:, :-1, :]
    logits = logits / temperature

    loss_mask = loss_mask[:, 1:]
    pd = torch.nn.functional.softmax(logits, dim=-1)
    entropy = torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)

    return _apply_mask(entropy, loss_mask, masked_mean_axis)


def _apply_mask(tensor: torch.Tensor, mask: torch.Tensor, masked_mean_axis: int | None) -> torch.Tensor:
    if masked_mean_axis is None:
        return (tensor * mask).sum() / (mask.sum() + 1e-8)  # Add small epsilon to avoid division by zero
    else:
        return ((tensor * mask).sum(dim=masked_mean_axis) / (mask.sum(dim=masked_mean_axis) + 1e-8)).mean()


# ---- src/zeroband/models.py
def get_model_and_tokenizer(attn_impl: str):
    config_model = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               rope_theta=10000.0, attn_implementation=attn_impl, bos_token_id=PAD,
                               eos_token_id=PAD, pad_token_id=PAD)
    config_model.use_cache = False
    model = Qwen2ForCausalLM(config_model)
    return model


# ---- the ParquetDataset row -> DatasetOutput (input_tokens + output_tokens, loss_mask 0 / 1)
def make_sample(in_token, out_token, advantage, reward):
    input_ids = torch.tensor(in_token)
    output_ids = torch.tensor(out_token)
    ids = torch.cat([input_ids, output_ids], dim=0)
    logprobs = torch.cat([torch.zeros(len(input_ids)), -torch.rand(len(output_ids))], dim=0)
    loss_mask = torch.cat([torch.zeros(len(input_ids)), torch.ones(len(output_ids))], dim=0).int()
    adv = torch.tensor([advantage] * len(ids))
    return {"input_ids": ids, "advantages": adv, "rewards": reward, "loss_mask": loss_mask, "logprobs": logprobs}


def random_rollouts(n, g):
    out = []
    for _ in range(n):
        p = int(torch.randint(3, 8, (1,), generator=g))
        c = int(torch.randint(2, 9, (1,), generator=g))
        out.append(make_sample(torch.randint(1, 97, (p,), generator=g).tolist(),
                               torch.randint(1, 97, (c,), generator=g).tolist(),
                               float(torch.randn(1, generator=g)), float(torch.rand(1, generator=g))))
    return out


# ---- reference: every sample alone, unpadded, default positions, no mask
def reference_token_terms(model, sample, temperature):
    ids = sample["input_ids"].unsqueeze(0)
    logits = model(input_ids=ids).logits[:, :-1, :] / temperature
    logps = selective_log_softmax(logits, ids[:, 1:])[0]
    pd = torch.softmax(logits, dim=-1)
    entropy = (torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1))[0]
    return logps, entropy


def locate(micro_batch, sample):
    """(row, offset) of a sample inside a micro-batch (sample ids are unique)."""
    L = len(sample["input_ids"])
    for r in range(micro_batch["input_ids"].shape[0]):
        row = micro_batch["input_ids"][r]
        for off in range(row.shape[0] - L + 1):
            if torch.equal(row[off:off + L], sample["input_ids"]) and int(micro_batch["position_ids"][r, off]) == 0:
                return r, off
    return None


def run(collate_mode, micro_bs, seq_length):
    temperature, eps_low, eps_high, entropy_loss_coeff, masked_mean_axis = 0.6, 0.2, 0.2, 0.001, None
    step_per_rollout = 2
    model = get_model_and_tokenizer("sdpa")
    ref_model = deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(7)
    rollouts = [random_rollouts(6, g) for _ in range(step_per_rollout)]
    max_diff = 0.0

    # here we want to pre-compute the logprobs with the model before update
    with torch.no_grad():
        data = []
        for rollout_step in range(step_per_rollout):
            batch_packed = packed_batch(rollouts[rollout_step], seq_length, PAD, micro_bs, collate_mode)
            for batch in batch_packed:
                input_ids = batch["input_ids"]
                logits = model(input_ids=input_ids, position_ids=batch["position_ids"]).logits.contiguous()
                input_ids = input_ids[:, 1:]
                logits = logits[:, :-1, :] / temperature
                per_token_logps = selective_log_softmax(logits, input_ids)
                batch["logprobs"] = per_token_logps
            data.append(batch_packed)

        # the packed logprob pass against each sample alone
        ref_logps = []
        for rollout_step in range(step_per_rollout):
            ref_logps.append([reference_token_terms(ref_model, s, temperature)[0] for s in rollouts[rollout_step]])
            for s, lp in zip(rollouts[rollout_step], ref_logps[-1]):
                found = [(mb, locate(mb, s)) for mb in data[rollout_step] if locate(mb, s) is not None]
                assert len(found) == 1
                mb, (r, off) = found[0]
                got = mb["logprobs"][r, off:off + len(s["input_ids"]) - 1]
                d = (got - lp).abs().max().item()
                max_diff = max(max_diff, d)
                assert d < 1e-10, (collate_mode, d)

    max_ratio_gap = 0.0
    for rollout_step in range(step_per_rollout):
        data_per_rollout = data[rollout_step]
        num_grad_acc_steps = len(data_per_rollout)
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        for grad_acc_step in range(num_grad_acc_steps):
            batch = data_per_rollout[grad_acc_step]
            input_ids = batch["input_ids"]
            loss_mask = batch["loss_mask"]
            logits = model(input_ids=input_ids, position_ids=batch["position_ids"]).logits.contiguous()
            advantages = batch["advantages"]
            original_logprobs = batch["logprobs"]
            pg_loss, clip_ratio = grpo_loss(logits, input_ids, advantages, original_logprobs, loss_mask,
                                            temperature, eps_low, eps_high, masked_mean_axis)
            entropy = entropy_loss(logits, loss_mask, temperature, masked_mean_axis)
            loss = pg_loss - entropy_loss_coeff * entropy
            loss = loss / num_grad_acc_steps
            loss.backward()

            # mirror: the same micro-batch's samples, each alone
            num, ent_num, den = 0.0, 0.0, 0.0
            seen = set()
            for r in range(input_ids.shape[0]):
                for off in range(input_ids.shape[1]):
                    if int(batch["position_ids"][r, off]) != 0:
                        continue
                    for si, s in enumerate(rollouts[rollout_step]):
                        L = len(s["input_ids"])
                        if si in seen or not torch.equal(input_ids[r, off:off + L], s["input_ids"]):
                            continue
                        seen.add(si)
                        lp, ent = reference_token_terms(ref_model, s, temperature)
                        m = s["loss_mask"][1:]
                        adv = s["advantages"][1:]
                        coef_1 = torch.exp(lp - ref_logps[rollout_step][si])
                        max_ratio_gap = max(max_ratio_gap, ((coef_1 - 1).abs() * m).max().item())
                        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
                        per_tok = torch.max(-coef_1 * adv, -coef_2 * adv)
                        num = num + (per_tok * m).sum()
                        ent_num = ent_num + (ent * m).sum()
                        den = den + m.sum()
            assert len(seen) == int(batch["seq_lens"].numel())
            ref_loss = ((num / (den + 1e-8)) - entropy_loss_coeff * (ent_num / (den + 1e-8))) / num_grad_acc_steps
            ref_loss.backward()
            d = (loss - ref_loss).abs().item()
            max_diff = max(max_diff, d)
            assert d < 1e-10, (collate_mode, rollout_step, grad_acc_step, d)

        for (n, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
            d = (p.grad - p_ref.grad).abs().max().item()
            max_diff = max(max_diff, d)
            assert d < 1e-10, (collate_mode, n, d)
        if rollout_step == 1:
            # off-policy: after the first update the ratio is no longer 1
            assert max_ratio_gap > 1e-3, max_ratio_gap
        optimizer.step()
        ref_optimizer.step()

    for p, p_ref in zip(model.parameters(), ref_model.parameters()):
        d = (p - p_ref).abs().max().item()
        max_diff = max(max_diff, d)
        assert d < 1e-10, (collate_mode, d)
    return data, max_diff


def main():
    data, d_pack = run("packing", micro_bs=1, seq_length=32)
    # several samples share a row, and some rows end in a pad block whose positions restart at 0
    assert any(int(b["seq_lens"].numel()) >= 2 for b in data[0])
    assert any(int(b["seq_lens"].sum()) < b["input_ids"].shape[1] for b in data[0])
    _, d_pad = run("padding", micro_bs=2, seq_length=16)
    _, d_bal = run("balancing", micro_bs=2, seq_length=16)
    print(f"ok: prime-rl packed / padded / balanced micro-batches with reset position_ids and no mask match every "
          f"sample alone (max diff {max(d_pack, d_pad, d_bal):.2e})")


if __name__ == "__main__":
    main()
