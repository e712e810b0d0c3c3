"""SFT with pad == eos: TRL's collator builds the attention mask from each example's length, so the final eos
of every conversation is attended and trained on, while the identical pad ids after it are not.

Follows huggingface/trl trl/trainer/sft_trainer.py:
  SFTTrainer.__init__ / _prepare_dataset: when the tokenizer has no pad token, the common recipe sets
      tokenizer.pad_token = tokenizer.eos_token (pad_token_id == eos_token_id), and the tokenize step
      appends eos_token to each example that does not already end with it;
  DataCollatorForLanguageModeling.torch_call:
      input_ids = [torch.tensor(example["input_ids"]) for example in examples]
      attention_mask = [torch.ones_like(ids) for ids in input_ids]
      output["input_ids"] = pad(input_ids, padding_value=self.pad_token_id, padding_side="right")
      output["attention_mask"] = pad(attention_mask, padding_value=0, padding_side="right")
      output["labels"] = pad(labels, padding_value=-100, padding_side="right")
      with completion_only_loss: labels[completion_mask == 0] = -100.
The mask comes from the lengths, not from input_ids != pad_token_id: the eos inside an example is a real
token with the same id as the padding.
Reduced: LlamaForCausalLM from a tiny LlamaConfig (no weights), float64, a chat-like prompt + completion.
Check: per-example loss and the logits at every real position equal those of the example alone, unpadded.
"""
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)

EOS = 2
PAD = EOS  # tokenizer.pad_token = tokenizer.eos_token
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
config._attn_implementation = "sdpa"
model = LlamaForCausalLM(config).double().eval()

# examples: [bos, prompt..., completion..., eos]; one turn has an eos inside (end of the user turn)
examples = []
for n_prompt, n_completion in ((4, 6), (3, 2), (5, 4)):
    prompt = torch.cat([torch.tensor([1]), torch.randint(3, 64, (n_prompt,)), torch.tensor([EOS])])
    completion = torch.cat([torch.randint(3, 64, (n_completion,)), torch.tensor([EOS])])
    examples.append({"input_ids": torch.cat([prompt, completion]),
                     "completion_mask": torch.cat([torch.zeros(len(prompt), dtype=torch.long),
                                                   torch.ones(len(completion), dtype=torch.long)])})


def pad(tensors, padding_value):
    T = max(len(t) for t in tensors)
    return torch.stack([F.pad(t, (0, T - len(t)), value=padding_value) for t in tensors])


def torch_call(examples):  # DataCollatorForLanguageModeling, completion_only_loss=True
    input_ids = [ex["input_ids"] for ex in examples]
    attention_mask = [torch.ones_like(ids) for ids in input_ids]
    labels = [ex["input_ids"].clone() for ex in examples]
    output = {"input_ids": pad(input_ids, PAD), "attention_mask": pad(attention_mask, 0), "labels": pad(labels, -100)}
    completion_mask = pad([ex["completion_mask"] for ex in examples], 0)
    output["labels"][completion_mask == 0] = -100
    return output


def per_example_loss(logits, labels):
    shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
    tok = F.cross_entropy(shift_logits.transpose(1, 2), shift_labels, ignore_index=-100, reduction="none")
    return tok.sum(1) / (shift_labels != -100).sum(1)


batch = torch_call(examples)
assert (batch["attention_mask"].sum(1) == torch.tensor([len(ex["input_ids"]) for ex in examples])).all()
with torch.no_grad():
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    loss_b = per_example_loss(out.logits, batch["labels"])
    worst_logit, worst_loss = 0.0, 0.0
    for i, ex in enumerate(examples):
        n = len(ex["input_ids"])
        single = torch_call([ex])
        out_i = model(input_ids=single["input_ids"], attention_mask=single["attention_mask"])
        worst_logit = max(worst_logit, (out_i.logits[0] - out.logits[i, :n]).abs().max().item())
        worst_loss = max(worst_loss, abs(per_example_loss(out_i.logits, single["labels"])[0] - loss_b[i]).item())
        assert single["labels"][0, -1] == EOS  # the completion's eos is trained on
print(f"max |batched - alone|: logits {worst_logit:.3e}, per-example loss {worst_loss:.3e}")
assert worst_logit < 1e-10 and worst_loss < 1e-10
