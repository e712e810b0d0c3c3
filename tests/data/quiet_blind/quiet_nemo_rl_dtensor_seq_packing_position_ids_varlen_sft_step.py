# Correct program (quiet batch quiet-r112a).
#
# Ported from NVIDIA-NeMo/RL (nemo_rl/models/huggingface/common.py @1fa3e204d60c20227ce3135a3162054566b7e317:
# FlashAttentionKwargs, group_and_cat_tensors, pack_sequences, get_flash_attention_kwargs;
# nemo_rl/models/policy/dtensor_policy_worker.py @0126d86c19d9c0bf097e8019b7ad09752b6971c3: DTensorPolicyWorker.train,
# the `enable_seq_packing` branch; nemo_rl/algorithms/loss_functions.py: SequencePackingLossWrapper, NLLLoss).
#
# With sequence packing on, the DTensor worker flattens a microbatch of right-padded sequences into one row
# (packed_sequence_size=[len(input_lengths)]), pads that row with eos up to train_mb_tokens, numbers positions
# from 0 in every sequence (the padding tail gets position 0), and calls the HF model with attention_mask=None,
# those position_ids and flash_attn_kwargs. The model runs flash_attention_2, which finds the documents from the
# restarting position_ids and runs flash_attn_varlen_func over them; here a plain-torch varlen stand-in, registered
# with transformers' AttentionInterface, takes its place on CPU. The loss wrapper walks cu_seqlens and scores every
# sequence on its own slice of the logits. The model is a tiny Qwen2 built from Qwen2Config, no download.
import sys
from dataclasses import dataclass
from typing import Any, Optional, Tuple, TypeVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForCausalLM, Qwen2Config
from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

Tensor = TypeVar("Tensor", bound=torch.Tensor)


# --------------------------------------------------------------------------- nemo_rl/models/huggingface/common.py
@dataclass
class FlashAttentionKwargs:
    """Dataclass to hold FlashAttention v2 kwargs."""

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def group_and_cat_tensors(
    tensors: list[torch.Tensor],
    group_sizes: list[int],
    padding_value: int = 0,
    min_seq_len: int = 0,
) -> torch.Tensor:
    grouped = []
    index = 0
    for size in group_sizes:
        group = tensors[index : index + size]
        concat = torch.cat(group, dim=0)
        grouped.append(concat)
        index += size

    # Compute the maximum length for padding
    max_len = max(t.size(0) for t in grouped)
    max_len = max(max_len, min_seq_len)

    # Pad each tensor to max_len
    padded = torch.stack(
        [torch.nn.functional.pad(t, (0, max_len - t.size(0)), value=padding_value) for t in grouped]
    )

    return padded


def pack_sequences(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    packed_sequence_size: list[int],
    padding_value: int = 0,
    return_attention_mask: bool = True,
    min_seq_len: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    flat_input_ids = []
    position_ids = []
    flat_lengths = input_lengths.tolist()

    for i, seq_len in enumerate(flat_lengths):
        flat_input_ids.append(input_ids[i, :seq_len])
        position_ids.append(torch.arange(seq_len, dtype=torch.long, device=input_ids.device))

    # Group and pad
    input_ids_packed = group_and_cat_tensors(
        flat_input_ids, packed_sequence_size, padding_value, min_seq_len=min_seq_len
    )
    position_ids_packed = group_and_cat_tensors(
        position_ids, packed_sequence_size, padding_value=0, min_seq_len=min_seq_len
    )

    # Compute max length
    batch_size, max_seq_len = input_ids_packed.shape

    attention_mask = None
    if return_attention_mask:
        attention_mask = torch.zeros(
            (batch_size, max_seq_len, max_seq_len), dtype=torch.bool, device=input_ids.device
        )
        index = 0
        for i, group_size in enumerate(packed_sequence_size):
            group_lengths = flat_lengths[index : index + group_size]
            total_len = sum(group_lengths)
            attention_mask[i, :total_len, :total_len] = torch.tril(
                torch.ones((total_len, total_len), dtype=torch.bool, device=input_ids.device)
            )
            index += group_size

    return input_ids_packed, position_ids_packed, attention_mask


def get_flash_attention_kwargs(input_lengths: torch.Tensor) -> FlashAttentionKwargs:
    """Returns kwargs required for FlashAttention v2 forward functions."""
    input_lengths_int32 = input_lengths.to(torch.int32)
    cu_seqlens = torch.nn.functional.pad(input_lengths_int32.cumsum(dim=0), (1, 0))  # prepend 0
    max_len = input_lengths.max().item()

    return FlashAttentionKwargs(
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens.clone(),  # same for self-attention
        max_seqlen_q=max_len,
        max_seqlen_k=max_len,
    )


# --------------------------------------------------------------------------- flash_attn_varlen_func on CPU
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False):
    """(total, heads, dim) q/k/v; each [cu[i], cu[i+1]) span attends only within itself."""
    out = torch.empty_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[qs:qe].transpose(0, 1)
        ki = k[ks:ke].transpose(0, 1).repeat_interleave(groups, dim=0)
        vi = v[ks:ke].transpose(0, 1).repeat_interleave(groups, dim=0)
        oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, scale=softmax_scale)
        out[qs:qe] = oi.transpose(0, 1)
    return out


def varlen_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Stands in for transformers' flash_attention_2 on a packed row: attention_mask is None, the documents are
    read from the restarting position_ids (the path _flash_attention_forward takes with _is_packed_sequence)."""
    position_ids = kwargs.get("position_ids")
    batch_size, _, q_len, _ = query.shape
    query = query.transpose(1, 2)  # (b, s, h, d), flash layout
    key = key.transpose(1, 2)
    value = value.transpose(1, 2)
    if attention_mask is None and _is_packed_sequence(position_ids, batch_size):
        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    else:
        assert attention_mask is None, "the packed path only"
        lengths = torch.full((batch_size,), q_len, dtype=torch.int32)
        cu_q = cu_k = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        max_q = max_k = q_len
    out = flash_attn_varlen_func(
        query.reshape(-1, query.shape[-2], query.shape[-1]),
        key.reshape(-1, key.shape[-2], key.shape[-1]),
        value.reshape(-1, value.shape[-2], value.shape[-1]),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        softmax_scale=scaling,
        causal=module.is_causal,
    )
    return out.view(batch_size, q_len, out.shape[-2], out.shape[-1]), None


AttentionInterface.register("varlen_cpu", varlen_attention_forward)


# --------------------------------------------------------------------------- nemo_rl/algorithms/loss_functions.py
class BatchedDataDict(dict):
    def slice(self, start: int, end: int) -> "BatchedDataDict":
        return BatchedDataDict({k: v[start:end] for k, v in self.items()})


def masked_mean(values, mask, dim=None, global_normalization_factor=None):
    normalization_factor = torch.sum(mask, dim=dim) if global_normalization_factor is None else global_normalization_factor
    return torch.sum(values * mask, dim=dim) / (normalization_factor + 1e-8)


class NLLLoss:
    """Negative Log Likelihood Loss function."""

    def __call__(self, next_token_logits, data, global_valid_seqs, global_valid_toks, **kwargs):
        # logits shape: [batch_size, seq_len, vocab_size]
        # Get the next token logits for each position
        token_mask = data["token_mask"][:, 1:]
        sample_mask = data["sample_mask"]
        mask = token_mask * sample_mask.unsqueeze(-1)
        next_token_logits = next_token_logits.to(torch.float32)

        next_tokens = data["input_ids"][:, 1:]
        logits = next_token_logits[:, :-1]
        next_token_logprobs = torch.nn.functional.log_softmax(logits, dim=-1)
        token_logprobs = next_token_logprobs.gather(dim=-1, index=next_tokens.unsqueeze(-1)).squeeze(-1)

        num_unmasked_tokens = torch.sum(mask)
        loss = -masked_mean(token_logprobs, mask, global_normalization_factor=global_valid_toks)

        return loss, {
            "loss": loss.item() if loss.ndim == 0 else loss,
            "num_unmasked_tokens": num_unmasked_tokens.item(),
            "num_valid_samples": sample_mask.sum().item(),
        }


class SequencePackingLossWrapper:
    def __init__(self, loss_fn, cu_seqlens_q: Tensor, cu_seqlens_q_padded: Optional[Tensor] = None):
        self.loss_fn = loss_fn
        self.cu_seqlens_q = cu_seqlens_q
        self.cu_seqlens_q_padded = cu_seqlens_q_padded

    def __call__(self, next_token_logits, data, global_valid_seqs, global_valid_toks):
        """Wraps a loss function to handle sequence packing by doing one sequence at a time to avoid excessive padding."""
        unpadded_cu_seqlens = self.cu_seqlens_q
        unpadded_seq_lengths = self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]
        if self.cu_seqlens_q_padded is not None:
            padded_cu_seqlens = self.cu_seqlens_q_padded
            padded_seq_lengths = self.cu_seqlens_q_padded[1:] - self.cu_seqlens_q_padded[:-1]
        else:
            padded_cu_seqlens = unpadded_cu_seqlens
            padded_seq_lengths = unpadded_seq_lengths
        seq_starts = padded_cu_seqlens[:-1]
        seq_ends = padded_cu_seqlens[1:]

        loss_accum = 0
        metrics_accum = {}
        for seq_idx in range(len(seq_starts)):
            seq_start = seq_starts[seq_idx].item()

            # get sequence and unpad all 'data' tensors. The data dict is a BatchedDataDict of unpacked tensors
            seq_data = data.slice(seq_idx, seq_idx + 1)
            unpadded_seq_data = {}
            for k, v in seq_data.items():
                if isinstance(v, torch.Tensor) and v.ndim > 1 and v.shape[1] > 1:
                    unpadded_seq_data[k] = v[:, : unpadded_seq_lengths[seq_idx]]
                else:
                    unpadded_seq_data[k] = v

            logit_slice_idxs = slice(seq_start, seq_start + padded_seq_lengths[seq_idx])
            next_token_logits_slice = next_token_logits[:, logit_slice_idxs, :]

            loss, metrics = self.loss_fn(next_token_logits_slice, unpadded_seq_data, global_valid_seqs,
                                         global_valid_toks)
            loss_accum += loss
            for k, v in metrics.items():
                if k not in metrics_accum:
                    metrics_accum[k] = 0
                metrics_accum[k] += v

        return loss_accum, metrics_accum


# --------------------------------------------------------------------------- DTensorPolicyWorker.train (one rank)
class DTensorPolicyWorker:
    def __init__(self, cfg: dict, model, eos_token_id: int):
        self.cfg = cfg
        self.model = model
        self.eos_token_id = eos_token_id
        self.enable_seq_packing = cfg["sequence_packing"]["enabled"]
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["optimizer"]["lr"])
        self.max_grad_norm = cfg["max_grad_norm"]

    def train_microbatch(self, mb: BatchedDataDict, loss_fn, global_valid_seqs, global_valid_toks):
        if self.enable_seq_packing:
            input_ids = mb.get("input_ids")
            input_ids, position_ids, _ = pack_sequences(
                input_ids=input_ids,
                input_lengths=mb["input_lengths"],
                packed_sequence_size=[len(mb["input_lengths"])],  # flash attention 2 expects flattened input
                padding_value=self.eos_token_id,
                return_attention_mask=False,
                min_seq_len=self.cfg["sequence_packing"]["train_mb_tokens"],
            )
            seq_len = input_ids.shape[1]
            attention_mask = None
            flash_attn_kwargs = get_flash_attention_kwargs(input_lengths=mb["input_lengths"])
        else:
            input_ids = mb.get("input_ids")
            batch_size, seq_len = input_ids.shape
            attention_mask = torch.ones((batch_size, seq_len), dtype=torch.bool, device=input_ids.device)
            position_ids = torch.arange(seq_len, device=input_ids.device).repeat(batch_size, 1)
            flash_attn_kwargs = {}

        model_args = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            flash_attn_kwargs=flash_attn_kwargs,
        )
        outputs = self.model(**model_args)
        logits = outputs.logits
        del outputs

        if self.enable_seq_packing:
            loss_fn_ = SequencePackingLossWrapper(
                loss_fn=loss_fn,
                cu_seqlens_q=flash_attn_kwargs.cu_seqlens_q,
                cu_seqlens_q_padded=flash_attn_kwargs.cu_seqlens_q,
            )
        else:
            loss_fn_ = loss_fn
        loss, loss_metrics = loss_fn_(logits, mb, global_valid_seqs, global_valid_toks)
        return loss, loss_metrics, logits

    def train(self, mb: BatchedDataDict, loss_fn):
        self.model.train()
        global_valid_seqs = mb["sample_mask"].sum()
        global_valid_toks = (mb["token_mask"][:, 1:] * mb["sample_mask"].unsqueeze(-1)).sum()
        self.optimizer.zero_grad()
        loss, loss_metrics, logits = self.train_microbatch(mb, loss_fn, global_valid_seqs, global_valid_toks)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()}
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return loss.detach(), loss_metrics, logits.detach(), grads, grad_norm


# --------------------------------------------------------------------------- run + reference
def build_model(attn_implementation: str):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=1,
        pad_token_id=1,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    model.config.use_cache = False
    return model.to(torch.float32)


def main():
    cfg = {
        "sequence_packing": {"enabled": True, "train_mb_tokens": 24},
        "optimizer": {"lr": 1e-3},
        "max_grad_norm": 1.0,
    }
    eos = 1
    g = torch.Generator().manual_seed(1)
    input_lengths = torch.tensor([5, 7, 3, 6])
    max_len = int(input_lengths.max())
    input_ids = torch.full((len(input_lengths), max_len), eos, dtype=torch.long)  # right-padded
    token_mask = torch.zeros_like(input_ids, dtype=torch.float32)
    for i, n in enumerate(input_lengths.tolist()):
        input_ids[i, :n] = torch.randint(2, 64, (n,), generator=g)
        token_mask[i, 2:n] = 1.0  # first two tokens are the prompt
    mb = BatchedDataDict(
        input_ids=input_ids,
        input_lengths=input_lengths,
        token_mask=token_mask,
        sample_mask=torch.ones(len(input_lengths)),
    )

    model = build_model("varlen_cpu")
    reference = build_model("eager")
    reference.load_state_dict(model.state_dict())

    worker = DTensorPolicyWorker(cfg, model, eos_token_id=eos)
    loss, metrics, logits, grads, grad_norm = worker.train(mb, NLLLoss())
    print(f"packed row {logits.shape[1]} tokens (train_mb_tokens={cfg['sequence_packing']['train_mb_tokens']}), "
          f"loss {loss.item():.6f}, unmasked tokens {metrics['num_unmasked_tokens']}, grad norm {grad_norm:.4f}")

    # Reference: every sequence alone, unpadded, through the eager model, the same NLL summed over sequences.
    global_valid_toks = (token_mask[:, 1:]).sum()
    reference.zero_grad()
    ref_loss = 0.0
    cu = F.pad(input_lengths.cumsum(0), (1, 0))
    for i, n in enumerate(input_lengths.tolist()):
        ids = input_ids[i : i + 1, :n]
        out = reference(input_ids=ids, use_cache=False)
        torch.testing.assert_close(logits[:, cu[i] : cu[i + 1]], out.logits.detach(), rtol=1e-5, atol=1e-5)
        logp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        ref_loss = ref_loss - (logp * token_mask[i, 1:n]).sum() / global_valid_toks
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    print(f"reference loss {ref_loss.item():.6f}; logits and grads match the per-sequence eager runs")


if __name__ == "__main__":
    main()
