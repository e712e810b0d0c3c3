"""SimPO's concatenated chosen/rejected forward on a tiny Gemma-2 (sliding + global layers).

Ported from princeton-nlp/SimPO scripts/simpo_trainer.py (commit 15c4ff89):
  * tokenize_row(): [bos] + prompt, answer + [eos]; labels = input_ids with the prompt part
    set to label_pad_token_id (-100),
  * DPODataCollatorWithPadding (trl): right padding, input_ids with pad_token_id,
    attention_mask with 0, labels with -100,
  * concatenated_inputs(): pad chosen and rejected to one max_length (pad_to_length) and cat on
    the batch axis,
  * concatenated_forward(): model(concatenated_input_ids, attention_mask=..., use_cache=False),
  * get_batch_logps(average_log_prob=True): length-normalised log-prob over the response,
  * simpo_loss(): -logsigmoid(beta * (pi_chosen - pi_rejected - gamma_beta_ratio)).
SimPO ships training_configs/gemma-2-9b-it-simpo.yaml; the policy here is transformers'
Gemma2ForCausalLM built from a tiny Gemma2Config: layers alternate sliding_attention (window 4)
and full_attention, eager attention with logit soft-capping. Right padding keeps every real
token's window and causal prefix the same as in the unpadded sequence.

Check: each chosen / rejected sequence run alone, unpadded, gives the same average log-prob
and hence the same SimPO loss.
"""
import torch
import torch.nn.functional as F
from transformers import Gemma2Config, Gemma2ForCausalLM

torch.manual_seed(0)

PAD, BOS, EOS = 0, 2, 1
LABEL_PAD = -100


def pad_to_length(tensor, length, pad_value, dim=-1):
    if tensor.size(dim) >= length:
        return tensor
    pad_size = list(tensor.shape)
    pad_size[dim] = length - tensor.size(dim)
    return torch.cat([tensor, pad_value * torch.ones(*pad_size, dtype=tensor.dtype, device=tensor.device)], dim=dim)


def tokenize_row(prompt_ids, chosen_ids, rejected_ids):
    prompt = [BOS] + prompt_ids
    row = {}
    for name, ans in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        ans = ans + [EOS]
        ids = prompt + ans
        labels = ids[:]
        labels[: len(prompt)] = [LABEL_PAD] * len(prompt)
        row[f"{name}_input_ids"] = ids
        row[f"{name}_attention_mask"] = [1] * len(ids)
        row[f"{name}_labels"] = labels
    return row


def dpo_collate(rows):
    """trl DPODataCollatorWithPadding, non encoder-decoder, right padding."""
    out = {}
    for k in rows[0]:
        seqs = [torch.tensor(r[k]) for r in rows]
        if k.endswith("_input_ids"):
            pv = PAD
        elif k.endswith("_labels"):
            pv = LABEL_PAD
        else:
            pv = 0
        out[k] = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pv)
    return out


def concatenated_inputs(batch, label_pad_token_id=-100, padding_value=0):
    concatenated_batch = {}
    max_length = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    for k in batch:
        if k.startswith("chosen") and isinstance(batch[k], torch.Tensor):
            if "labels" in k:
                pad_value = label_pad_token_id
            elif k.endswith("_input_ids"):
                pad_value = padding_value
            elif k.endswith("_attention_mask"):
                pad_value = 0
            concatenated_key = k.replace("chosen", "concatenated")
            concatenated_batch[concatenated_key] = pad_to_length(batch[k], max_length, pad_value=pad_value)
    for k in batch:
        if k.startswith("rejected") and isinstance(batch[k], torch.Tensor):
            if "labels" in k:
                pad_value = label_pad_token_id
            elif k.endswith("_input_ids"):
                pad_value = padding_value
            elif k.endswith("_attention_mask"):
                pad_value = 0
            concatenated_key = k.replace("rejected", "concatenated")
            concatenated_batch[concatenated_key] = torch.cat(
                (concatenated_batch[concatenated_key], pad_to_length(batch[k], max_length, pad_value=pad_value)), dim=0
            )
    return concatenated_batch


def get_batch_logps(logits, labels, average_log_prob=True, label_pad_token_id=-100):
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != label_pad_token_id
    labels[labels == label_pad_token_id] = 0
    per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    if average_log_prob:
        return (per_token_logps * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token_logps * loss_mask).sum(-1)


def simpo_loss(chosen_logps, rejected_logps, beta=2.0, gamma_beta_ratio=0.5):
    logits = chosen_logps - rejected_logps - gamma_beta_ratio
    return -F.logsigmoid(beta * logits)


def concatenated_forward(model, batch):
    cb = concatenated_inputs(batch, label_pad_token_id=LABEL_PAD, padding_value=PAD)
    len_chosen = batch["chosen_labels"].shape[0]
    all_logits = model(cb["concatenated_input_ids"], attention_mask=cb["concatenated_attention_mask"], use_cache=False).logits
    all_logps = get_batch_logps(all_logits, cb["concatenated_labels"], average_log_prob=True, label_pad_token_id=LABEL_PAD)
    return all_logps[:len_chosen], all_logps[len_chosen:], cb


def main():
    cfg = Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        sliding_window=4, query_pre_attn_scalar=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
    )
    cfg._attn_implementation = "eager"
    model = Gemma2ForCausalLM(cfg).eval()

    g = torch.Generator().manual_seed(1)

    def rand(n):
        return torch.randint(3, 64, (n,), generator=g).tolist()

    rows = [
        tokenize_row(rand(5), rand(7), rand(2)),
        tokenize_row(rand(9), rand(3), rand(8)),
        tokenize_row(rand(3), rand(11), rand(4)),
    ]
    batch = dpo_collate(rows)

    with torch.no_grad():
        chosen_logps, rejected_logps, cb = concatenated_forward(model, batch)
        losses = simpo_loss(chosen_logps, rejected_logps)

        ok = True
        ref_c, ref_r = [], []
        for r in rows:
            for name, store in (("chosen", ref_c), ("rejected", ref_r)):
                ids = torch.tensor([r[f"{name}_input_ids"]])
                lab = torch.tensor([r[f"{name}_labels"]])
                logits = model(ids, use_cache=False).logits
                store.append(get_batch_logps(logits, lab, average_log_prob=True)[0])
        ref_c, ref_r = torch.stack(ref_c), torch.stack(ref_r)
        ref_losses = simpo_loss(ref_c, ref_r)
        print("concatenated shape", tuple(cb["concatenated_input_ids"].shape))
        print("chosen  logps batch", chosen_logps.numpy().round(5), "alone", ref_c.numpy().round(5))
        print("rejected logps batch", rejected_logps.numpy().round(5), "alone", ref_r.numpy().round(5))
        ok &= torch.allclose(chosen_logps, ref_c, atol=1e-5)
        ok &= torch.allclose(rejected_logps, ref_r, atol=1e-5)
        ok &= torch.allclose(losses, ref_losses, atol=1e-5)
        print(f"simpo loss batch {losses.mean().item():.6f} alone {ref_losses.mean().item():.6f}")
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
