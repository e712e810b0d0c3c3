# Citation: instructlab/training @fa5b53b (src/instructlab/training/sampler.py last changed in
#   1f02ea6625b854fcc2362b76ea3f12cf15d45d0a: mb_collate_fn, padded_mb_collate_fn; src/instructlab/training/model.py
#   and batch_loss_manager.py last changed in e2cad6cd4bc8686009f10d1471566f7d37c8a6a3: Model.compute_loss,
#   BatchLossManager._prepare_model_inputs).
# InstructLab's SFT trainer, flash mode: MaxTokensPerRankCollator packs each rank's minibatch with mb_collate_fn,
# which concatenates the samples into ONE row with no padding and no attention_mask, and numbers the tokens with
# position_ids that restart at 0 for every sample. The model (a HF causal LM loaded with
# attn_implementation="flash_attention_2") gets input_ids, labels and position_ids, and transformers recovers each
# sample's span from the restarting position_ids (FA2 varlen there; on CPU the SDPA path used here finds the same
# spans with masking_utils.find_packed_sequence_indices and builds a block-causal mask). With flash disabled,
# padded_mb_collate_fn right-pads to the longest sample with pad_token_id and sends a 0/1 attention_mask instead.
# compute_loss shifts logits / labels over the whole packed row; each sample's first label is -100 (its prompt is
# masked), so the cross-sample shift never counts.
# Self-check: for three chat samples (5, 7 and 4 tokens) the packed run's logits on each sample's span, and the padded
# run's logits on real tokens, equal the sample run alone (no mask, positions from 0); the packed primary_loss and the
# padded primary_loss both equal the sum over samples of each sample's own token losses; num_loss_counted_tokens
# equals the count of labels != -100.
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)


# ---- src/instructlab/training/sampler.py ----
def mb_collate_fn(minibatch, batch_num_loss_counted_tokens):
    input_ids = []
    labels = []
    position_ids = []
    total_len = 0
    num_loss_counted_tokens = 0
    num_samples = 0

    for item in minibatch:
        item_len = len(item["input_ids"])

        input_ids.extend(item["input_ids"])
        labels.extend(item["labels"])
        position_ids.extend(range(item_len))

        total_len += item_len
        num_loss_counted_tokens += item["num_loss_counted_tokens"]

        # Dummy samples don't have labels != -100 and should not count
        num_samples += 1 if item["num_loss_counted_tokens"] > 0 else 0

    return {
        "input_ids": torch.tensor([input_ids], dtype=torch.long),
        "labels": torch.tensor([labels], dtype=torch.long),
        "position_ids": torch.tensor([position_ids], dtype=torch.long),
        "num_loss_counted_tokens": num_loss_counted_tokens,
        "num_samples": num_samples,
        "batch_num_loss_counted_tokens": batch_num_loss_counted_tokens,
        "total_length": total_len,  # Total tokens in the batch
    }


def padded_mb_collate_fn(minibatch, batch_num_loss_counted_tokens, pad_token_id=0):
    max_len = max(len(item["input_ids"]) for item in minibatch)

    padded_input_ids = []
    padded_labels = []
    attention_masks = []
    num_loss_counted_tokens = 0
    num_samples = 0

    for item in minibatch:
        item_len = len(item["input_ids"])

        pad_length = max_len - item_len
        input_ids = item["input_ids"]
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.tolist()
        padded_input = input_ids + [pad_token_id] * pad_length
        padded_input_ids.append(padded_input)

        labels = item["labels"]
        if isinstance(labels, torch.Tensor):
            labels = labels.tolist()
        padded_label = labels + [-100] * pad_length
        padded_labels.append(padded_label)

        # Create attention mask (1 for real tokens, 0 for padding)
        attention_mask = [1] * item_len + [0] * pad_length
        attention_masks.append(attention_mask)

        num_loss_counted_tokens += item["num_loss_counted_tokens"]
        if item["num_loss_counted_tokens"] > 0:
            num_samples += 1

    return {
        "input_ids": torch.tensor(padded_input_ids, dtype=torch.long),
        "labels": torch.tensor(padded_labels, dtype=torch.long),
        "attention_mask": torch.tensor(attention_masks, dtype=torch.long),
        "num_loss_counted_tokens": num_loss_counted_tokens,
        "num_samples": num_samples,
        "batch_num_loss_counted_tokens": batch_num_loss_counted_tokens,
        "total_length": max_len * len(minibatch),  # Total padded tokens
    }


# ---- src/instructlab/training/batch_loss_manager.py: BatchLossManager._prepare_model_inputs ----
def prepare_model_inputs(mb, device="cpu"):
    model_inputs = dict(
        input_ids=mb["input_ids"].to(device=device),
        labels=mb["labels"].to(device=device),
    )
    if "attention_mask" in mb:
        model_inputs["attention_mask"] = mb["attention_mask"].to(device=device)
    if "position_ids" in mb:
        model_inputs["position_ids"] = mb["position_ids"].to(device=device)
    return model_inputs


# ---- src/instructlab/training/model.py: Model.compute_loss (no MoE aux loss) ----
def compute_loss(model, inputs, world_size, samples_in_batch):
    output = model(
        **inputs,
        use_cache=False,
    )
    logits = output.logits
    labels = inputs["labels"]

    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = labels[..., 1:].contiguous()

    shift_logits = shift_logits.view(-1, shift_logits.size(-1))
    shift_labels = shift_labels.view(-1)

    loss_fct = torch.nn.CrossEntropyLoss(reduction="none")
    token_losses = loss_fct(shift_logits, shift_labels)

    valid_tokens = shift_labels != -100
    primary_loss = token_losses[valid_tokens].sum()
    scaled_main_loss = primary_loss * world_size / samples_in_batch
    return scaled_main_loss, primary_loss, logits


# ---- a tiny Llama and three tokenized chat samples (prompt labels -100, as data_process writes them) ----
PAD = 0
config = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=2,
)
config._attn_implementation = "sdpa"
model = LlamaForCausalLM(config).eval()


def sample(prompt, response):
    ids = [1] + prompt + response + [2]
    labels = [-100] * (1 + len(prompt)) + response + [2]
    return {"input_ids": ids, "labels": labels, "len": len(ids), "num_loss_counted_tokens": len(response) + 1}


minibatch = [
    sample([10, 11], [20]),  # 5 tokens
    sample([12, 13, 14], [21, 22]),  # 7 tokens
    sample([15], [23]),  # 4 tokens
]
batch_num_loss_counted_tokens = sum(s["num_loss_counted_tokens"] for s in minibatch)

with torch.no_grad():
    # flash mode: one packed row, position_ids restart per sample
    packed = mb_collate_fn(minibatch, batch_num_loss_counted_tokens)
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]]
    _, packed_loss, packed_logits = compute_loss(
        model, prepare_model_inputs(packed), world_size=1, samples_in_batch=batch_num_loss_counted_tokens
    )

    # non-flash mode: right-padded rows with an attention_mask
    padded = padded_mb_collate_fn(minibatch, batch_num_loss_counted_tokens, pad_token_id=PAD)
    _, padded_loss, padded_logits = compute_loss(
        model, prepare_model_inputs(padded), world_size=1, samples_in_batch=batch_num_loss_counted_tokens
    )

    # reference: each sample alone, no mask, positions from 0
    expected_loss = torch.zeros(())
    counted = 0
    start = 0
    for row, item in enumerate(minibatch):
        n = item["len"]
        ids = torch.tensor([item["input_ids"]])
        labels = torch.tensor(item["labels"])
        ref_logits = model(input_ids=ids, use_cache=False).logits[0]
        torch.testing.assert_close(packed_logits[0, start : start + n], ref_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded_logits[row, :n], ref_logits, atol=1e-5, rtol=1e-5)
        for t in range(n - 1):
            if labels[t + 1] != -100:
                expected_loss = expected_loss + torch.nn.functional.cross_entropy(ref_logits[t], labels[t + 1])
                counted += 1
        start += n

    torch.testing.assert_close(packed_loss, expected_loss, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(padded_loss, expected_loss, atol=1e-4, rtol=1e-5)
    assert counted == packed["num_loss_counted_tokens"] == padded["num_loss_counted_tokens"]

print("instructlab packed (position_ids) and padded (attention_mask) minibatches match each sample alone")
