"""Extractive QA over long contexts split into overlapping windows (doc_stride), the way
huggingface/transformers examples/pytorch/question-answering/run_qa.py (prepare_validation_features,
DataCollatorWithPadding, eval_dataset.remove_columns(["example_id", "offset_mapping"])) and utils_qa.py
(postprocess_qa_predictions) do it, with a tiny DistilBertForQuestionAnswering built from a config.

Each example becomes several features: [CLS] question [SEP] context-window [SEP], windows overlapping by
`stride` tokens (return_overflowing_tokens=True, truncation="only_second"). The features are padded on the
right by the collator to the longest one in the batch; the padding mask goes to the model as
attention_mask. Post-processing keeps only spans whose tokens are context tokens (offset_mapping set to None
for question/special tokens, and indices past the unpadded length skipped).

Reference: every feature run alone, unpadded, with no attention mask at all. Logits at real positions and the
final answer texts must match.
"""
import collections

import numpy as np
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import DataCollatorWithPadding, DistilBertConfig, DistilBertForQuestionAnswering, PreTrainedTokenizerFast

torch.manual_seed(0)

WORDS = ("where did the cat sit who ran to park dog a mat on in house blue red green big small "
         "what is color of near tree bird sang song sat and").split()
vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + ["##s", "##ed"])}
backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
backend.normalizer = normalizers.Lowercase()
backend.pre_tokenizer = pre_tokenizers.Whitespace()
backend.post_processor = processors.TemplateProcessing(
    single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
)
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
    mask_token="[MASK]", padding_side="right",
)
pad_on_right = tokenizer.padding_side == "right"

examples = {
    "id": ["q0", "q1", "q2"],
    "question": ["  where did the cat sit", "who ran", "what color is the big house"],
    "context": [
        "the cat sat on a mat in the house and the dog ran to the park near a big tree",
        "the dog ran",
        "a bird sang a song in the tree near the big blue house and the small house is red",
    ],
}
max_seq_length, doc_stride = 16, 4


def prepare_validation_features(examples):
    examples["question"] = [q.lstrip() for q in examples["question"]]
    tokenized_examples = tokenizer(
        examples["question" if pad_on_right else "context"],
        examples["context" if pad_on_right else "question"],
        truncation="only_second" if pad_on_right else "only_first",
        max_length=max_seq_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding=False,
    )
    sample_mapping = tokenized_examples.pop("overflow_to_sample_mapping")
    tokenized_examples["example_id"] = []
    for i in range(len(tokenized_examples["input_ids"])):
        sequence_ids = tokenized_examples.sequence_ids(i)
        context_index = 1 if pad_on_right else 0
        sample_index = sample_mapping[i]
        tokenized_examples["example_id"].append(examples["id"][sample_index])
        tokenized_examples["offset_mapping"][i] = [
            (o if sequence_ids[k] == context_index else None)
            for k, o in enumerate(tokenized_examples["offset_mapping"][i])
        ]
    return tokenized_examples


def postprocess_qa_predictions(examples, features, predictions, n_best_size=5, max_answer_length=6):
    all_start_logits, all_end_logits = predictions
    example_id_to_index = {k: i for i, k in enumerate(examples["id"])}
    features_per_example = collections.defaultdict(list)
    for i, ex_id in enumerate(features["example_id"]):
        features_per_example[example_id_to_index[ex_id]].append(i)
    all_predictions = collections.OrderedDict()
    for example_index, ex_id in enumerate(examples["id"]):
        context = examples["context"][example_index]
        prelim_predictions = []
        for feature_index in features_per_example[example_index]:
            start_logits = all_start_logits[feature_index]
            end_logits = all_end_logits[feature_index]
            offset_mapping = features["offset_mapping"][feature_index]
            start_indexes = np.argsort(start_logits)[-1 : -n_best_size - 1 : -1].tolist()
            end_indexes = np.argsort(end_logits)[-1 : -n_best_size - 1 : -1].tolist()
            for start_index in start_indexes:
                for end_index in end_indexes:
                    if (
                        start_index >= len(offset_mapping)
                        or end_index >= len(offset_mapping)
                        or offset_mapping[start_index] is None
                        or len(offset_mapping[start_index]) < 2
                        or offset_mapping[end_index] is None
                        or len(offset_mapping[end_index]) < 2
                    ):
                        continue
                    if end_index < start_index or end_index - start_index + 1 > max_answer_length:
                        continue
                    prelim_predictions.append(
                        {
                            "offsets": (offset_mapping[start_index][0], offset_mapping[end_index][1]),
                            "score": start_logits[start_index] + end_logits[end_index],
                        }
                    )
        predictions_ = sorted(prelim_predictions, key=lambda x: x["score"], reverse=True)[:n_best_size]
        for pred in predictions_:
            pred["text"] = context[pred["offsets"][0] : pred["offsets"][1]]
        all_predictions[ex_id] = predictions_[0]["text"] if predictions_ else ""
    return all_predictions


def create_and_fill_np_array(start_or_end_logits, dataset, max_len):
    # run_qa_no_trainer.py: concatenate batch logits, filling past each batch's width with -100
    step = 0
    logits_concat = np.full((len(dataset), max_len), -100, dtype=np.float64)
    for output_logit in start_or_end_logits:
        batch_size, cols = output_logit.shape
        if step + batch_size < len(dataset):
            logits_concat[step : step + batch_size, :cols] = output_logit
        else:
            logits_concat[step:, :cols] = output_logit[: len(dataset) - step]
        step += batch_size
    return logits_concat


config = DistilBertConfig(
    vocab_size=len(vocab), dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64,
    dropout=0.0, attention_dropout=0.0, qa_dropout=0.0, pad_token_id=0,
)
model = DistilBertForQuestionAnswering(config).double().eval()

features = prepare_validation_features({k: list(v) for k, v in examples.items()})
n_feat = len(features["input_ids"])
print("features per example:", collections.Counter(features["example_id"]))
feats_for_model = [
    {"input_ids": features["input_ids"][i], "attention_mask": features["attention_mask"][i]} for i in range(n_feat)
]
collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=None)

# batched, right-padded evaluation loop (batch size 4 -> features of several examples mixed in a batch)
all_start, all_end = [], []
with torch.no_grad():
    for b in range(0, n_feat, 4):
        batch = collator(feats_for_model[b : b + 4])
        print("batch", b // 4, "shape", tuple(batch["input_ids"].shape), "pad positions per row",
              (batch["attention_mask"] == 0).sum(-1).tolist())
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        all_start.append(out.start_logits.numpy())
        all_end.append(out.end_logits.numpy())
max_len = max(x.shape[1] for x in all_start)
start_batched = create_and_fill_np_array(all_start, feats_for_model, max_len)
end_batched = create_and_fill_np_array(all_end, feats_for_model, max_len)

# reference: every feature alone, no padding, no mask
max_diff = 0.0
ref_start = np.full((n_feat, max_len), -100.0)
ref_end = np.full((n_feat, max_len), -100.0)
with torch.no_grad():
    for i in range(n_feat):
        ids = torch.tensor([features["input_ids"][i]])
        out = model(input_ids=ids)
        L = ids.shape[1]
        ref_start[i, :L] = out.start_logits[0].numpy()
        ref_end[i, :L] = out.end_logits[0].numpy()
        max_diff = max(max_diff, np.abs(ref_start[i, :L] - start_batched[i, :L]).max(),
                       np.abs(ref_end[i, :L] - end_batched[i, :L]).max())

pred_batched = postprocess_qa_predictions(examples, features, (start_batched, end_batched))
pred_ref = postprocess_qa_predictions(examples, features, (ref_start, ref_end))
print("max |logit diff| padded batch vs each window alone:", max_diff)
print("answers (batched):", dict(pred_batched))
print("answers (alone):  ", dict(pred_ref))
ok = max_diff < 1e-10 and pred_batched == pred_ref
print("MATCH" if ok else "MISMATCH")
assert ok
