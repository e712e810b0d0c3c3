# Citation: huggingface/trl @f2cd57710ae345ea6428ae95363267fcf38a3dc8: trl/trainer/sft_trainer.py
#   (SFTTrainer._prepare_dataset: tokenize_fn with return_assistant_tokens_mask=assistant_only_loss, build_labels,
#   pack_dataset; DataCollatorForLanguageModeling.torch_call with padding_free=True and
#   get_position_ids_from_packed_seq_lengths; self.padding_free = ... packing_strategy "bfd"), trl/data_utils.py
#   (_tokenize: apply_chat_template(tokenize=True, return_dict=True); _pack_bfd: best-fit-decreasing bins and a
#   "seq_lengths" column; its segment tree is replaced here by a linear best-fit search).
# Multi-turn chat SFT with assistant_only_loss and BFD packing: the chat template marks assistant turns with
# {% generation %}, so apply_chat_template returns assistant_masks and labels are -100 outside assistant replies;
# conversations are packed into rows of max_length, and the padding-free collator returns position_ids that restart
# at 0 for every conversation and NO attention_mask, so the model (transformers' packed-sequence detection from
# position_ids, SDPA here instead of flash-attn, no cache as in SFTTrainer's forward) keeps each conversation to
# itself; labels at position 0 are -100, and the tail that pads the flat row to a multiple of 8 has position 0 each.
# Tokenizer: a character-level PreTrainedTokenizerFast built in memory with ChatML-style specials and template.
# Self-check: each conversation alone, unpadded and unmasked (positions 0..n-1): logits at every token and the loss,
# a mean over assistant tokens by a double loop, per packed row and over the batch.
import json
from collections import defaultdict, deque

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

torch.manual_seed(0)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer():
    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;?!'+-\n[UNK]"))
    vocab = {t: i for i, t in enumerate(specials + ["[UNK]"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ---- trl/data_utils.py ----
def _tokenize(processing_class, input, **apply_chat_template_kwargs):
    if isinstance(input, list):  # conversational: list of message dicts
        result = processing_class.apply_chat_template(
            input, tokenize=True, return_dict=True, **apply_chat_template_kwargs
        )
    else:
        result = processing_class(text=input)
    return result


def _pack_bfd(examples, seq_length):
    """Best Fit Decreasing over the examples' lengths ("truncate" overflow); adds "seq_lengths"."""
    examples = [{k: v[:seq_length] for k, v in ex.items()} for ex in examples if len(ex["input_ids"]) > 0]
    order = sorted(range(len(examples)), key=lambda i: -len(examples[i]["input_ids"]))
    bins = []
    for idx in order:
        length = len(examples[idx]["input_ids"])
        fits = [b for b in bins if seq_length - b["length"] >= length]
        if fits:
            bin = min(fits, key=lambda b: seq_length - b["length"])
        else:
            bin = {"ids": [], "length": 0}
            bins.append(bin)
        bin["ids"].append(idx)
        bin["length"] += length
    packed = []
    for bin in bins:
        row = {k: sum((examples[i][k] for i in bin["ids"]), []) for k in examples[0]}
        row["seq_lengths"] = [len(examples[i]["input_ids"]) for i in bin["ids"]]
        packed.append((row, bin["ids"]))
    return packed


def pad(tensors, padding_value=0, padding_side="right", pad_to_multiple_of=None):
    output_shape = [max(t.shape[0] for t in tensors)]
    if pad_to_multiple_of is not None:
        output_shape[0] = ((output_shape[0] + pad_to_multiple_of - 1) // pad_to_multiple_of) * pad_to_multiple_of
    output = torch.full((len(tensors), *output_shape), padding_value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        output[i, : t.shape[0]] = t
    return output


# ---- trl/trainer/sft_trainer.py ----
def tokenize_fn(example, processing_class, dataset_text_field, assistant_only_loss, chat_template):
    tools = example.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    apply_chat_template_kwargs = {
        "chat_template": chat_template,
        "tools": tools,
        **example.get("chat_template_kwargs", {}),
    }
    processed = _tokenize(
        processing_class,
        example["messages"],
        return_assistant_tokens_mask=assistant_only_loss,
        **apply_chat_template_kwargs,
    )
    output = {k: processed[k] for k in ("input_ids", "assistant_masks") if k in processed}
    if "assistant_masks" in output and 1 not in output["assistant_masks"]:
        raise RuntimeError("at least one example has no assistant tokens")
    return output


def build_labels(example, mask_columns):
    masks = [example[column] for column in mask_columns]
    labels = [
        token_id if all(bits) else -100
        for token_id, *bits in zip(example["input_ids"], *masks, strict=False)
    ]
    return {"labels": labels}


class DataCollatorForLanguageModeling:
    def __init__(self, pad_token_id, padding_free=False, pad_to_multiple_of=None):
        self.pad_token_id = pad_token_id
        self.padding_free = padding_free
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples):
        input_ids = [example["input_ids"] for example in examples]
        batch_seq_lengths = [example["seq_lengths"] for example in examples] if "seq_lengths" in examples[0] else None
        labels = [example.get("labels", example["input_ids"]) for example in examples]

        input_ids = [torch.tensor(ids) for ids in input_ids]
        labels = [torch.tensor(lbl) for lbl in labels]

        if self.padding_free:
            if batch_seq_lengths is not None:
                position_ids = self.get_position_ids_from_packed_seq_lengths(batch_seq_lengths)
            else:
                position_ids = [torch.arange(len(ids)) for ids in input_ids]
        else:
            attention_mask = [torch.ones_like(ids) for ids in input_ids]

        output = {}
        if self.padding_free:
            input_ids = [torch.cat(input_ids, dim=0)]
            labels = [torch.cat(labels, dim=0)]
            position_ids = [torch.cat(position_ids, dim=0)]

        output["input_ids"] = pad(
            input_ids,
            padding_value=self.pad_token_id,
            padding_side="right",
            pad_to_multiple_of=self.pad_to_multiple_of,
        )
        output["labels"] = pad(
            labels, padding_value=-100, padding_side="right", pad_to_multiple_of=self.pad_to_multiple_of
        )
        if self.padding_free:
            output["position_ids"] = pad(
                position_ids, padding_value=0, padding_side="right", pad_to_multiple_of=self.pad_to_multiple_of
            )
            output["labels"][output["position_ids"] == 0] = -100
        else:
            output["attention_mask"] = pad(
                attention_mask, padding_value=0, padding_side="right", pad_to_multiple_of=self.pad_to_multiple_of
            )
        return output

    @staticmethod
    def get_position_ids_from_packed_seq_lengths(batch_seq_lengths):
        example_lengths = [sum(seq_lengths) for seq_lengths in batch_seq_lengths]
        batch_seq_lengths = torch.tensor(
            [seq_length for seq_lengths in batch_seq_lengths for seq_length in seq_lengths]
        )
        position_ids = torch.ones(sum(example_lengths), dtype=batch_seq_lengths.dtype)
        position_ids[0] = 0
        position_ids[batch_seq_lengths[:-1].cumsum(0)] = -(batch_seq_lengths[:-1] - 1)
        position_ids = position_ids.cumsum(0)
        return list(position_ids.split(example_lengths))


dataset = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4."}, {"role": "user", "content": "and 3+3?"},
                  {"role": "assistant", "content": "6."}]},
    {"messages": [{"role": "user", "content": "a color?"}, {"role": "assistant", "content": "teal"}]},
    {"messages": [{"role": "user", "content": "three animals"}, {"role": "assistant", "content": "cat, dog, owl"},
                  {"role": "user", "content": "one more"}, {"role": "assistant", "content": "fox"}]},
    {"messages": [{"role": "user", "content": "say yes"}, {"role": "assistant", "content": "yes"}]},
    {"messages": [{"role": "system", "content": "You are a poet."}, {"role": "user", "content": "rain"},
                  {"role": "assistant", "content": "Soft rain on the roof, a quiet drum."}]},
]

tokenizer = build_tokenizer()
max_length = 128
assistant_only_loss = True
padding_free = True  # packing_strategy "bfd" turns it on

tokenized = [tokenize_fn(ex, tokenizer, "text", assistant_only_loss, CHAT_TEMPLATE) for ex in dataset]
labelled = []
for ex in tokenized:
    row = {"input_ids": ex["input_ids"]}
    row.update(build_labels(ex, ["assistant_masks"]))
    labelled.append(row)
for ex, row in zip(dataset, labelled):  # the labels keep exactly each assistant reply and its <|im_end|>
    kept = "".join(tokenizer.convert_ids_to_tokens([t for t in row["labels"] if t != -100]))
    assert kept == "".join(m["content"] + "<|im_end|>" for m in ex["messages"] if m["role"] == "assistant"), kept
packed = _pack_bfd(labelled, max_length)
assert len(packed) >= 2 and any(len(ids) > 1 for _, ids in packed)

collator = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=padding_free,
                                           pad_to_multiple_of=8)

config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
model = LlamaForCausalLM(config).eval()
model.config._attn_implementation = "sdpa"
for p in model.parameters():
    torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else torch.nn.init.uniform_(p, 0.8, 1.2)

with torch.no_grad():
    # the Trainer batches packed rows; each batch here is one packed row, then all rows together
    for group in [[0], [1], list(range(len(packed)))]:
        rows = [packed[g][0] for g in group]
        batch = collator(rows)
        assert "attention_mask" not in batch
        out = model(**batch, use_cache=False)  # SFTTrainer's loss path runs the backbone with use_cache=False

        total, count, offset = 0.0, 0, 0
        for g in group:
            for idx in packed[g][1]:
                ids = torch.tensor(labelled[idx]["input_ids"])
                lbl = labelled[idx]["labels"]
                n = ids.numel()
                ref_logits = model(input_ids=ids[None]).logits[0]
                torch.testing.assert_close(out.logits[0, offset:offset + n], ref_logits, atol=1e-4, rtol=1e-4)
                for t in range(n - 1):
                    if lbl[t + 1] != -100:
                        total += -torch.log_softmax(ref_logits[t], -1)[lbl[t + 1]].item()
                        count += 1
                offset += n
        assert abs(out.loss.item() - total / count) < 1e-4, (out.loss.item(), total / count)
        print(f"rows {group}: {batch['input_ids'].shape[1]} tokens, seq_lengths "
              f"{[packed[g][0]['seq_lengths'] for g in group]}, loss {out.loss.item():.4f} (reference {total / count:.4f})")
print("ok")
