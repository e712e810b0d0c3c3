"""OPCD (on-policy context distillation, microsoft/LMOps opcd/verl): top-k "full" KL gathered from the
remove-padding log-probs as if every sample's valid tokens ended at the end of its row.

Citation: microsoft/LMOps#399, commit b18ead0 ("opcd oel: fix bug of attn mask in topk padding"),
opcd/verl/verl/workers/actor/dp_actor.py DataParallelPPOActor._forward_micro_batch (the same change was made in
oel/verl). Bug state read at b18ead0^ together with opcd/verl/verl/trainer/ppo/core_algos.py (kl_penalty "full",
agg_loss), verl/utils/torch_functional.py (get_response_mask, logprobs_from_logits, entropy_from_logits,
masked_mean), verl/utils/model.py (compute_position_id_with_mask) and the on_policy_merge branch of
opcd/verl/verl/trainer/ppo/ray_trainer.py (compute_topk_indices -> exp_log_prob -> update_actor).

Bug: with use_remove_padding the rollout rows (left-padded prompt + right-padded response) are unpadded with
unpad_input(input_ids, attention_mask) and run as one packed row. For kl_loss_type=full with kl_topk > 0, "Step 2"
gathers each sample's log-probs at the given top-k token ids straight from the packed log-probs, per sample via
cu_seqlens. It took the last min(R, len - 1) logits of the sample's packed segment and put them at the END of the
response window (resp_offset = R - n_valid). That only holds when the response has no right padding: for a response
that stopped at EOS before response_length, the valid tokens end before the row does, so every response position
got the log-probs of a position as many tokens earlier as the response has padding (prompt positions included).

Fix: locate the sample's first valid column from `indices` (the attention mask's nonzero positions), and map the
response window columns [seqlen - R - 1, seqlen - 1) onto the packed segment by column, gathering only the
response positions that are valid.

This program: a tiny Qwen2ForCausalLM student (actor) and its frozen copy as the teacher (ref, REF_MODEL_PATH
defaults to MODEL_PATH), a batch of prompts and the same batch with an "experience" context put before each prompt,
responses that stop at EOS at different lengths. Step 1 takes the student's top-k ids over the response, the
teacher then scores them with the experience in context, and the student's update computes the top-k full KL,
token-mean over response_mask. DataProto / TensorDict / the OmegaConf config are replaced by small stand-ins,
flash_attn.bert_padding is ported in torch, bf16 autocast, ulysses, fused kernels and multimodal inputs are dropped.
"""
import copy
import sys
from typing import List, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

FIXED = "--fixed" in sys.argv

PAD, EOS = 0, 2


class Cfg(dict):
    """Stands in for the OmegaConf DictConfig verl passes around (attribute access and .get)."""

    __getattr__ = dict.__getitem__


# ---- flash_attn.bert_padding (what dp_actor imports), in torch -------------------------------------------------


def index_first_axis(input, indices):
    return input[indices]


def index_put_first_axis(values, indices, first_axis_dim):
    output = torch.zeros((first_axis_dim, *values.shape[1:]), device=values.device, dtype=values.dtype)
    output[indices] = values
    return output


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    b, s = hidden_states.shape[:2]
    return (
        index_first_axis(hidden_states.reshape(b * s, *hidden_states.shape[2:]), indices),
        indices,
        cu_seqlens,
        max_seqlen_in_batch,
        used_seqlens_in_batch,
    )


def pad_input(hidden_states, indices, batch, seqlen):
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])


# ---- verl/utils ------------------------------------------------------------------------------------------------


def compute_position_id_with_mask(mask):
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0, max=None)


def get_response_mask(response_id: torch.Tensor, eos_token: Union[int, List[int]] = 2, dtype=torch.int64):
    eos_mask = torch.isin(response_id, torch.tensor(eos_token, device=response_id.device)).int()
    return (eos_mask.cumsum(dim=1) - eos_mask).eq(0).to(dtype)


def logprobs_from_logits(logits, labels, inplace_backward=True):
    # flash-attn cross entropy is not available here: verl's fallback, logprobs_from_logits_v2
    logits_labels = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    logsumexp_values = torch.stack([torch.logsumexp(logit, dim=-1) for logit in logits])
    return logits_labels - logsumexp_values


def entropy_from_logits(logits: torch.Tensor):
    pd = torch.nn.functional.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


# ---- verl/trainer/ppo/core_algos.py (opcd) ---------------------------------------------------------------------


def kl_penalty(logprob: torch.FloatTensor, ref_logprob: torch.FloatTensor, kl_penalty, kl_renorm_topk=False):
    if kl_penalty == "full":
        if kl_renorm_topk:
            mask = logprob > -1e15
            logprob = logprob - torch.logsumexp(torch.where(mask, logprob, torch.full_like(logprob, -1e20)), dim=-1, keepdim=True)
            ref_logprob = ref_logprob - torch.logsumexp(torch.where(mask, ref_logprob, torch.full_like(ref_logprob, -1e20)), dim=-1, keepdim=True)
        kl_density = logprob.exp() * (logprob - ref_logprob)
        kl_density = torch.where(logprob > -1e15, kl_density, torch.zeros_like(kl_density))
        kl = kl_density.sum(dim=-1)
        return kl
    raise NotImplementedError


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str):
    if loss_agg_mode == "token-mean":
        loss = masked_mean(loss_mat, loss_mask)
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


# ---- verl/workers/actor/dp_actor.py (opcd) ---------------------------------------------------------------------


class DataParallelPPOActor:
    def __init__(self, config, actor_module: nn.Module, actor_optimizer: torch.optim.Optimizer = None):
        """When optimizer is None, it is Reference Policy"""
        self.config = config
        self.actor_module = actor_module
        self.actor_optimizer = actor_optimizer
        self.use_remove_padding = self.config.get("use_remove_padding", False)
        self.compute_entropy_from_logits = entropy_from_logits

    def _forward_micro_batch(self, micro_batch, temperature, calculate_entropy=False, return_all_logits=False) -> Tuple[torch.Tensor, torch.Tensor]:
        """
        Returns:
            entropy: # (bs, response_len)
            log_probs: # (bs, response_len)
        """
        response_length = micro_batch["responses"].size(-1)
        multi_modal_inputs = {}

        input_ids = micro_batch["input_ids"]
        batch_size, seqlen = input_ids.shape
        attention_mask = micro_batch["attention_mask"]
        position_ids = micro_batch["position_ids"]
        entropy = None

        if self.use_remove_padding:
            input_ids_rmpad, indices, cu_seqlens, *_ = unpad_input(input_ids.unsqueeze(-1), attention_mask)  # input_ids_rmpad (total_nnz, ...)
            input_ids_rmpad = input_ids_rmpad.transpose(0, 1)  # (1, total_nnz)

            # unpad the position_ids to align the rotary
            position_ids_rmpad = index_first_axis(position_ids.unsqueeze(-1).reshape(batch_size * seqlen, 1), indices).transpose(0, 1)

            # for compute the log_prob
            input_ids_rmpad_rolled = torch.roll(input_ids_rmpad, shifts=-1, dims=1)  # (1, total_nnz)
            input_ids_rmpad_rolled = input_ids_rmpad_rolled.squeeze(0)

            output = self.actor_module(
                input_ids=input_ids_rmpad,
                attention_mask=None,
                position_ids=position_ids_rmpad,
                **multi_modal_inputs,
                use_cache=False,
            )  # prevent model thinks we are generating

            logits_rmpad = output.logits.squeeze(0)  # (total_nnz, vocab_size)
            logits_rmpad.div_(temperature)

            inplace_backward = True
            if calculate_entropy:
                inplace_backward = False

            if return_all_logits:
                chunk_size = logits_rmpad.size(0)
                log_probs = torch.empty_like(logits_rmpad)
                for i in range(0, logits_rmpad.size(0), chunk_size):
                    end = i + chunk_size
                    log_probs[i:end] = torch.nn.functional.log_softmax(logits_rmpad[i:end], dim=-1)
            else:
                log_probs = logprobs_from_logits(
                    logits=logits_rmpad,
                    labels=input_ids_rmpad_rolled,
                    inplace_backward=inplace_backward,
                )

            if calculate_entropy:
                entropy_rmpad = self.compute_entropy_from_logits(logits_rmpad)

            # pad back to (bsz, seqlen)
            if calculate_entropy:
                full_entropy = pad_input(
                    hidden_states=entropy_rmpad.unsqueeze(-1),
                    indices=indices,
                    batch=batch_size,
                    seqlen=seqlen,
                )

            topk_already_handled = False
            if return_all_logits and self.config.kl_topk > 0:
                # Optimization: handle topk BEFORE pad_input to avoid creating
                # the huge (bs, seqlen, vocab_size) padded tensor.
                kl_topk = self.config.kl_topk
                topk_already_handled = True

                if "kl_topk_indices" in micro_batch:
                    # Step 2: gather from rmpad log_probs per-sample using cu_seqlens
                    kl_indices = micro_batch["kl_topk_indices"].to(log_probs.device)  # (bs, R, K)
                    K = kl_indices.shape[-1]
                    R = response_length
                    gathered = torch.full((batch_size, R, K), -1e20, dtype=log_probs.dtype, device=log_probs.device)

                    if FIXED:
                        logit_slice_start = seqlen - R - 1
                        for si in range(batch_size):
                            actual_len = (cu_seqlens[si + 1] - cu_seqlens[si]).item()
                            if actual_len <= 0:
                                continue
                            first_valid_col = indices[cu_seqlens[si]].item() - si * seqlen
                            last_valid_col = first_valid_col + actual_len - 1

                            r_start = max(0, first_valid_col - logit_slice_start)
                            r_end = min(R - 1, last_valid_col - logit_slice_start)
                            n_valid_logits = r_end - r_start + 1
                            if n_valid_logits <= 0:
                                continue

                            rmpad_offset = (logit_slice_start + r_start) - first_valid_col
                            rmpad_start = cu_seqlens[si].item() + rmpad_offset
                            rmpad_end = rmpad_start + n_valid_logits
                            sample_log_probs = log_probs[rmpad_start:rmpad_end]  # (n_valid_logits, V)

                            sample_kl_indices = kl_indices[si, r_start:r_end + 1]  # (n_valid_logits, K)
                            valid_mask = sample_kl_indices != -1
                            safe_idx = torch.where(valid_mask, sample_kl_indices, torch.zeros_like(sample_kl_indices))
                            sample_gathered = torch.gather(sample_log_probs, -1, safe_idx.long())
                            gathered[si, r_start:r_end + 1] = torch.where(valid_mask, sample_gathered,
                                                                           torch.full_like(sample_gathered, -1e20))
                    else:
                        for si in range(batch_size):
                            actual_len = (cu_seqlens[si + 1] - cu_seqlens[si]).item()
                            n_valid = min(R, actual_len - 1)
                            if n_valid <= 0:
                                continue
                            rmpad_start = (cu_seqlens[si + 1]).item() - n_valid - 1
                            rmpad_end = (cu_seqlens[si + 1]).item() - 1
                            sample_log_probs = log_probs[rmpad_start:rmpad_end]  # (n_valid, V)

                            resp_offset = R - n_valid
                            sample_kl_indices = kl_indices[si, resp_offset:]  # (n_valid, K)
                            valid_mask = sample_kl_indices != -1
                            safe_idx = torch.where(valid_mask, sample_kl_indices, torch.zeros_like(sample_kl_indices))
                            sample_gathered = torch.gather(sample_log_probs, -1, safe_idx.long())  # (n_valid, K)
                            gathered[si, resp_offset:] = torch.where(valid_mask, sample_gathered,
                                                                     torch.full_like(sample_gathered, -1e20))

                    log_probs = gathered  # (bs, R, K)

                else:
                    # Step 1: topk on rmpad, pad small indices, slice response
                    _, topk_indices_rmpad = torch.topk(log_probs, k=kl_topk, dim=-1)  # (N, K)
                    topk_indices_padded = pad_input(
                        hidden_states=topk_indices_rmpad.float(),
                        indices=indices,
                        batch=batch_size,
                        seqlen=seqlen,
                    )  # (bs, S, K) — tiny
                    log_probs = topk_indices_padded[:, -response_length - 1 : -1]  # (bs, R, K)

            elif return_all_logits:
                full_log_probs = pad_input(hidden_states=log_probs, indices=indices, batch=batch_size, seqlen=seqlen)
                log_probs = full_log_probs[:, -response_length - 1 : -1]
            else:
                full_log_probs = pad_input(
                    hidden_states=log_probs.unsqueeze(-1),
                    indices=indices,
                    batch=batch_size,
                    seqlen=seqlen,
                )
                log_probs = full_log_probs.squeeze(-1)[:, -response_length - 1 : -1]  # (bsz, response_length)

            # only return response part:
            if calculate_entropy:
                entropy = full_entropy.squeeze(-1)[:, -response_length - 1 : -1]  # (bsz, response_length)

        else:  # not using rmpad and no ulysses sp
            topk_already_handled = False
            output = self.actor_module(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **multi_modal_inputs,
                use_cache=False,
            )  # prevent model thinks we are generating
            logits = output.logits
            logits.div_(temperature)
            logits = logits[:, -response_length - 1 : -1, :]  # (bsz, response_length, vocab_size)
            if return_all_logits:
                log_probs = torch.nn.functional.log_softmax(logits, dim=-1)
            else:
                log_probs = logprobs_from_logits(logits, micro_batch["responses"])
            if calculate_entropy:
                entropy = entropy_from_logits(logits)  # (bsz, response_length)

        # handle topk if needed (skip if already handled in rmpad optimization above)
        if return_all_logits and self.config.kl_topk > 0 and not topk_already_handled:
            if "kl_topk_indices" in micro_batch:
                indices = micro_batch["kl_topk_indices"].to(log_probs.device)
                valid_mask = indices != -1
                safe_indices = torch.where(valid_mask, indices, torch.zeros_like(indices))
                gathered_log_probs = torch.gather(log_probs, -1, safe_indices.long())
                log_probs = torch.where(valid_mask, gathered_log_probs, torch.full_like(gathered_log_probs, -1e20))
            else:
                _, indices = torch.topk(log_probs, k=self.config.kl_topk, dim=-1)  # (bs, seq, k)
                log_probs = indices.float()

        return entropy, log_probs

    def compute_log_prob(self, data, calculate_entropy=False):
        self.actor_module.eval()
        micro_batch_size = data["meta_info"]["micro_batch_size"]
        temperature = data["meta_info"]["temperature"]
        return_all_logits = data["meta_info"].get("return_all_logits", False)
        select_keys = ["responses", "input_ids", "attention_mask", "position_ids"]
        if "kl_topk_indices" in data:
            select_keys.append("kl_topk_indices")
        n = data["input_ids"].size(0)
        log_probs_lst, entropy_lst = [], []
        for start in range(0, n, micro_batch_size):
            micro_batch = {k: data[k][start:start + micro_batch_size] for k in select_keys}
            with torch.no_grad():
                entropy, log_probs = self._forward_micro_batch(micro_batch, temperature=temperature, calculate_entropy=calculate_entropy, return_all_logits=return_all_logits)
            log_probs_lst.append(log_probs)
            if calculate_entropy:
                entropy_lst.append(entropy)
        log_probs = torch.concat(log_probs_lst, dim=0)
        entropys = torch.concat(entropy_lst, dim=0) if calculate_entropy else None
        return log_probs, entropys

    def update_policy(self, data):
        self.actor_module.train()
        temperature = data["meta_info"]["temperature"]
        on_policy_merge = data["meta_info"]["on_policy_merge"]
        select_keys = ["responses", "input_ids", "attention_mask", "position_ids", "kl_topk_indices", "exp_log_probs"]
        batch = {k: data[k] for k in select_keys}
        n = batch["input_ids"].size(0)
        mb = self.config.ppo_micro_batch_size_per_gpu
        self.gradient_accumulation = n // mb
        metrics = {"actor/policy_loss": [], "actor/entropy": []}
        self.actor_optimizer.zero_grad()
        for start in range(0, n, mb):
            data = {k: v[start:start + mb] for k, v in batch.items()}
            responses = data["responses"]
            response_length = responses.size(1)
            attention_mask = data["attention_mask"]
            response_mask = attention_mask[:, -response_length:]

            loss_agg_mode = self.config.loss_agg_mode
            return_all_logits = self.config.kl_loss_type == "full"
            entropy, log_prob = self._forward_micro_batch(micro_batch=data, temperature=temperature, calculate_entropy=True, return_all_logits=return_all_logits)

            exp_log_prob = data["exp_log_probs"] if "exp_log_probs" in data else torch.zeros_like(log_prob)
            if on_policy_merge:
                kld = kl_penalty(logprob=log_prob, ref_logprob=exp_log_prob, kl_penalty=self.config.kl_loss_type, kl_renorm_topk=self.config.kl_renorm_topk)
            else:
                kld = kl_penalty(logprob=exp_log_prob, ref_logprob=log_prob, kl_penalty=self.config.kl_loss_type, kl_renorm_topk=self.config.kl_renorm_topk)
            policy_loss = agg_loss(loss_mat=kld, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
            entropy_agg = agg_loss(loss_mat=entropy, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)
            loss = policy_loss / self.gradient_accumulation
            loss.backward()
            metrics["actor/policy_loss"].append(policy_loss.detach().item())
            metrics["actor/entropy"].append(entropy_agg.detach().item())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.actor_module.parameters(), max_norm=self.config.grad_clip)
        self.actor_optimizer.step()
        self.actor_optimizer.zero_grad()
        metrics["actor/grad_norm"] = grad_norm.item()
        return metrics


# ---- rollout batch as the opcd ray_trainer builds it ---------------------------------------------------------


def left_pad(seqs, length):
    ids = torch.full((len(seqs), length), PAD, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, length - len(s):] = torch.tensor(s)
        mask[i, length - len(s):] = 1
    return ids, mask


def build_batch(prompt_seqs, responses, max_prompt_length):
    prompts, prompt_attention_mask = left_pad(prompt_seqs, max_prompt_length)
    prompt_position_ids = compute_position_id_with_mask(prompt_attention_mask)
    seq = torch.cat([prompts, responses], dim=-1)
    response_attention_mask = get_response_mask(response_id=responses, eos_token=EOS, dtype=prompt_attention_mask.dtype)
    attention_mask = torch.cat([prompt_attention_mask, response_attention_mask], dim=-1)
    response_length = responses.size(1)
    delta_position_id = torch.arange(1, response_length + 1).unsqueeze(0).expand(prompts.size(0), -1)
    response_position_ids = prompt_position_ids[..., -1:] + delta_position_id
    position_ids = torch.cat([prompt_position_ids, response_position_ids], dim=-1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": seq,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": attention_mask[:, -response_length:],
    }


def main():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=1,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    actor_module = Qwen2ForCausalLM(config).float()
    ref_module = copy.deepcopy(actor_module)  # REF_MODEL_PATH defaults to MODEL_PATH
    for p in ref_module.parameters():
        p.requires_grad_(False)

    actor_cfg = Cfg(
        use_remove_padding=True,
        kl_loss_type="full",
        kl_topk=16,
        kl_renorm_topk=False,
        loss_agg_mode="token-mean",
        ppo_micro_batch_size_per_gpu=4,
        grad_clip=1.0,
    )
    actor = DataParallelPPOActor(actor_cfg, actor_module, torch.optim.AdamW(actor_module.parameters(), lr=1e-3))
    ref_policy = DataParallelPPOActor(Cfg(actor_cfg), ref_module)

    g = torch.Generator().manual_seed(1)

    def toks(n):
        return torch.randint(3, config.vocab_size, (n,), generator=g).tolist()

    # the "experience" put in front of each prompt for the teacher
    experience = [toks(6), toks(9), toks(4), toks(7)]
    prompt_seqs = [toks(7), toks(4), toks(10), toks(5)]
    prompt_with_exp_seqs = [e + p for e, p in zip(experience, prompt_seqs)]

    # student responses (rollout.n = 1), right-padded after EOS to response_length
    response_length = 10
    resp_lens = [10, 6, 3, 8]  # the first one ran to response_length without EOS
    responses = torch.full((4, response_length), PAD, dtype=torch.long)
    for i, L in enumerate(resp_lens):
        r = toks(L)
        if L < response_length:
            r[-1] = EOS
        responses[i, :L] = torch.tensor(r)

    batch = build_batch(prompt_seqs, responses, max_prompt_length=12)
    batch_with_exp = build_batch(prompt_with_exp_seqs, responses, max_prompt_length=20)
    meta = {"micro_batch_size": 4, "temperature": 1.0}

    # get topk logits indices (on_policy_merge: the student's own top-k over its rollout)
    batch["meta_info"] = dict(meta, return_all_logits=True)
    batch_with_exp["meta_info"] = dict(meta, return_all_logits=True)
    log_probs, _ = actor.compute_log_prob(batch)
    actor_topk_indices = log_probs.long()
    batch_with_exp["kl_topk_indices"] = actor_topk_indices

    # use batch_with_exp to compute exp_log_prob (teacher with the experience in context)
    exp_log_prob, exp_entropys = ref_policy.compute_log_prob(batch_with_exp, calculate_entropy=True)
    exp_entropy = agg_loss(loss_mat=exp_entropys, loss_mask=batch_with_exp["response_mask"], loss_agg_mode="token-mean")
    batch["exp_log_probs"] = exp_log_prob
    batch["kl_topk_indices"] = batch_with_exp["kl_topk_indices"]

    # update actor
    batch["meta_info"] = dict(meta, on_policy_merge=True, stage_merge=True, multi_turn=False)
    metrics = actor.update_policy(batch)

    print(f"actor/exp_entropy {exp_entropy.item():.6f}")
    for k, v in metrics.items():
        v = v if isinstance(v, list) else [v]
        print(k, " ".join(f"{x:.6f}" for x in v))


if __name__ == "__main__":
    main()
