"""pytorch-transformers examples/run_squad.py: the SQuAD batch was unpacked with its mask and segment ids swapped.

Citation: huggingface/transformers#800 (fix: commit 71d597d "fix #800"; buggy parent 5fe0b378d, the 1.0 release).

The bug: load_and_cache_examples builds
``TensorDataset(all_input_ids, all_input_mask, all_segment_ids, all_start_positions, ...)``, but
train() and evaluate() read the batch as ``'token_type_ids': batch[1], 'attention_mask': batch[2]``.
BertForQuestionAnswering is fine-tuned and evaluated with the segment ids as its attention mask
(so [CLS], the question and its [SEP] are masked out as keys, and only the paragraph is attended)
and with the real-token mask as its token type ids.

The fix: ``'attention_mask': batch[1], 'token_type_ids': None if args.model_type == 'xlm' else batch[2]``.

This program keeps the script's layout (SquadExample / InputFeatures, convert_examples_to_features
with BERT's [CLS] q [SEP] p [SEP] layout, zero padding on the right with pad segment id 0, the
TensorDataset order, train() with AdamW and evaluate() reading start/end logits) with a tiny BertConfig,
random weights, a BertTokenizer loaded from a local word-level vocab.txt, and a few hand-written SQuAD examples.
"""

import collections
import os
import random
import sys
import tempfile

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, TensorDataset
from transformers import BertConfig, BertForQuestionAnswering, BertTokenizer

FIXED = "--fixed" in sys.argv


class Args:
    model_type = "bert"
    max_seq_length = 32
    doc_stride = 16
    max_query_length = 8
    per_gpu_train_batch_size = 4
    per_gpu_eval_batch_size = 4
    learning_rate = 1e-3
    adam_epsilon = 1e-8
    weight_decay = 0.0
    max_grad_norm = 1.0
    num_train_epochs = 20
    n_best_size = 5
    max_answer_length = 6
    seed = 42
    n_gpu = 0
    device = torch.device("cpu")


def set_seed(args):
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)


def to_list(tensor):
    return tensor.detach().cpu().tolist()


class SquadExample(object):
    def __init__(self, qas_id, question_text, doc_tokens, orig_answer_text=None,
                 start_position=None, end_position=None, is_impossible=None):
        self.qas_id = qas_id
        self.question_text = question_text
        self.doc_tokens = doc_tokens
        self.orig_answer_text = orig_answer_text
        self.start_position = start_position
        self.end_position = end_position
        self.is_impossible = is_impossible


class InputFeatures(object):
    def __init__(self, unique_id, example_index, doc_span_index, tokens, token_to_orig_map,
                 token_is_max_context, input_ids, input_mask, segment_ids, cls_index, p_mask,
                 paragraph_len, start_position=None, end_position=None, is_impossible=None):
        self.unique_id = unique_id
        self.example_index = example_index
        self.doc_span_index = doc_span_index
        self.tokens = tokens
        self.token_to_orig_map = token_to_orig_map
        self.token_is_max_context = token_is_max_context
        self.input_ids = input_ids
        self.input_mask = input_mask
        self.segment_ids = segment_ids
        self.cls_index = cls_index
        self.p_mask = p_mask
        self.paragraph_len = paragraph_len
        self.start_position = start_position
        self.end_position = end_position
        self.is_impossible = is_impossible


def read_squad_examples(input_data, is_training):
    examples = []
    for entry in input_data:
        for paragraph in entry["paragraphs"]:
            doc_tokens = paragraph["context"].split(" ")
            char_to_word_offset = []
            offset = 0
            for i, tok in enumerate(doc_tokens):
                char_to_word_offset.extend([i] * (len(tok) + 1))
            for qa in paragraph["qas"]:
                answer = qa["answers"][0]
                orig_answer_text = answer["text"]
                start_position = char_to_word_offset[answer["answer_start"]]
                end_position = char_to_word_offset[answer["answer_start"] + len(orig_answer_text) - 1]
                examples.append(SquadExample(qas_id=qa["id"], question_text=qa["question"],
                                             doc_tokens=doc_tokens, orig_answer_text=orig_answer_text,
                                             start_position=start_position, end_position=end_position,
                                             is_impossible=False))
    return examples


def _check_is_max_context(doc_spans, cur_span_index, position):
    best_score = None
    best_span_index = None
    for (span_index, doc_span) in enumerate(doc_spans):
        end = doc_span.start + doc_span.length - 1
        if position < doc_span.start or position > end:
            continue
        num_left_context = position - doc_span.start
        num_right_context = end - position
        score = min(num_left_context, num_right_context) + 0.01 * doc_span.length
        if best_score is None or score > best_score:
            best_score = score
            best_span_index = span_index
    return cur_span_index == best_span_index


def convert_examples_to_features(examples, tokenizer, max_seq_length,
                                 doc_stride, max_query_length, is_training,
                                 cls_token_at_end=False,
                                 cls_token='[CLS]', sep_token='[SEP]', pad_token=0,
                                 sequence_a_segment_id=0, sequence_b_segment_id=1,
                                 cls_token_segment_id=0, pad_token_segment_id=0,
                                 mask_padding_with_zero=True):
    """Loads a data file into a list of `InputBatch`s."""
    unique_id = 1000000000
    features = []
    for (example_index, example) in enumerate(examples):
        query_tokens = tokenizer.tokenize(example.question_text)
        if len(query_tokens) > max_query_length:
            query_tokens = query_tokens[0:max_query_length]

        tok_to_orig_index = []
        orig_to_tok_index = []
        all_doc_tokens = []
        for (i, token) in enumerate(example.doc_tokens):
            orig_to_tok_index.append(len(all_doc_tokens))
            sub_tokens = tokenizer.tokenize(token)
            for sub_token in sub_tokens:
                tok_to_orig_index.append(i)
                all_doc_tokens.append(sub_token)

        tok_start_position = None
        tok_end_position = None
        if is_training and not example.is_impossible:
            tok_start_position = orig_to_tok_index[example.start_position]
            if example.end_position < len(example.doc_tokens) - 1:
                tok_end_position = orig_to_tok_index[example.end_position + 1] - 1
            else:
                tok_end_position = len(all_doc_tokens) - 1

        # The -3 accounts for [CLS], [SEP] and [SEP]
        max_tokens_for_doc = max_seq_length - len(query_tokens) - 3

        _DocSpan = collections.namedtuple("DocSpan", ["start", "length"])
        doc_spans = []
        start_offset = 0
        while start_offset < len(all_doc_tokens):
            length = len(all_doc_tokens) - start_offset
            if length > max_tokens_for_doc:
                length = max_tokens_for_doc
            doc_spans.append(_DocSpan(start=start_offset, length=length))
            if start_offset + length == len(all_doc_tokens):
                break
            start_offset += min(length, doc_stride)

        for (doc_span_index, doc_span) in enumerate(doc_spans):
            tokens = []
            token_to_orig_map = {}
            token_is_max_context = {}
            segment_ids = []
            p_mask = []

            # CLS token at the beginning
            if not cls_token_at_end:
                tokens.append(cls_token)
                segment_ids.append(cls_token_segment_id)
                p_mask.append(0)
                cls_index = 0

            # Query
            for token in query_tokens:
                tokens.append(token)
                segment_ids.append(sequence_a_segment_id)
                p_mask.append(1)

            # SEP token
            tokens.append(sep_token)
            segment_ids.append(sequence_a_segment_id)
            p_mask.append(1)

            # Paragraph
            for i in range(doc_span.length):
                split_token_index = doc_span.start + i
                token_to_orig_map[len(tokens)] = tok_to_orig_index[split_token_index]
                is_max_context = _check_is_max_context(doc_spans, doc_span_index, split_token_index)
                token_is_max_context[len(tokens)] = is_max_context
                tokens.append(all_doc_tokens[split_token_index])
                segment_ids.append(sequence_b_segment_id)
                p_mask.append(0)
            paragraph_len = doc_span.length

            # SEP token
            tokens.append(sep_token)
            segment_ids.append(sequence_b_segment_id)
            p_mask.append(1)

            input_ids = tokenizer.convert_tokens_to_ids(tokens)

            # The mask has 1 for real tokens and 0 for padding tokens. Only real
            # tokens are attended to.
            input_mask = [1 if mask_padding_with_zero else 0] * len(input_ids)

            # Zero-pad up to the sequence length.
            while len(input_ids) < max_seq_length:
                input_ids.append(pad_token)
                input_mask.append(0 if mask_padding_with_zero else 1)
                segment_ids.append(pad_token_segment_id)
                p_mask.append(1)

            assert len(input_ids) == max_seq_length
            assert len(input_mask) == max_seq_length
            assert len(segment_ids) == max_seq_length

            span_is_impossible = example.is_impossible
            start_position = None
            end_position = None
            if is_training and not span_is_impossible:
                doc_start = doc_span.start
                doc_end = doc_span.start + doc_span.length - 1
                out_of_span = False
                if not (tok_start_position >= doc_start and tok_end_position <= doc_end):
                    out_of_span = True
                if out_of_span:
                    start_position = 0
                    end_position = 0
                    span_is_impossible = True
                else:
                    doc_offset = len(query_tokens) + 2
                    start_position = tok_start_position - doc_start + doc_offset
                    end_position = tok_end_position - doc_start + doc_offset

            if is_training and span_is_impossible:
                start_position = cls_index
                end_position = cls_index

            features.append(
                InputFeatures(unique_id=unique_id, example_index=example_index,
                              doc_span_index=doc_span_index, tokens=tokens,
                              token_to_orig_map=token_to_orig_map,
                              token_is_max_context=token_is_max_context,
                              input_ids=input_ids, input_mask=input_mask,
                              segment_ids=segment_ids, cls_index=cls_index, p_mask=p_mask,
                              paragraph_len=paragraph_len, start_position=start_position,
                              end_position=end_position, is_impossible=span_is_impossible))
            unique_id += 1
    return features


def load_and_cache_examples(args, tokenizer, input_data, evaluate=False):
    examples = read_squad_examples(input_data, is_training=not evaluate)
    features = convert_examples_to_features(examples=examples, tokenizer=tokenizer,
                                            max_seq_length=args.max_seq_length,
                                            doc_stride=args.doc_stride,
                                            max_query_length=args.max_query_length,
                                            is_training=not evaluate)

    # Convert to Tensors and build dataset
    all_input_ids = torch.tensor([f.input_ids for f in features], dtype=torch.long)
    all_input_mask = torch.tensor([f.input_mask for f in features], dtype=torch.long)
    all_segment_ids = torch.tensor([f.segment_ids for f in features], dtype=torch.long)
    all_cls_index = torch.tensor([f.cls_index for f in features], dtype=torch.long)
    all_p_mask = torch.tensor([f.p_mask for f in features], dtype=torch.float)
    if evaluate:
        all_example_index = torch.arange(all_input_ids.size(0), dtype=torch.long)
        dataset = TensorDataset(all_input_ids, all_input_mask, all_segment_ids,
                                all_example_index, all_cls_index, all_p_mask)
    else:
        all_start_positions = torch.tensor([f.start_position for f in features], dtype=torch.long)
        all_end_positions = torch.tensor([f.end_position for f in features], dtype=torch.long)
        dataset = TensorDataset(all_input_ids, all_input_mask, all_segment_ids,
                                all_start_positions, all_end_positions,
                                all_cls_index, all_p_mask)
    return dataset, examples, features


def train(args, train_dataset, model, tokenizer):
    """ Train the model """
    train_sampler = RandomSampler(train_dataset)
    train_dataloader = DataLoader(train_dataset, sampler=train_sampler, batch_size=args.per_gpu_train_batch_size)
    no_decay = ['bias', 'LayerNorm.weight']
    optimizer_grouped_parameters = [
        {'params': [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], 'weight_decay': args.weight_decay},
        {'params': [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], 'weight_decay': 0.0}
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate, eps=args.adam_epsilon)

    global_step = 0
    tr_loss = 0.0
    model.zero_grad()
    set_seed(args)
    for _ in range(int(args.num_train_epochs)):
        for step, batch in enumerate(train_dataloader):
            model.train()
            batch = tuple(t.to(args.device) for t in batch)
            if FIXED:
                inputs = {'input_ids':       batch[0],
                          'attention_mask':  batch[1],
                          'token_type_ids':  None if args.model_type == 'xlm' else batch[2],
                          'start_positions': batch[3],
                          'end_positions':   batch[4]}
            else:
                inputs = {'input_ids':       batch[0],
                          'token_type_ids':  None if args.model_type == 'xlm' else batch[1],  # XLM don't use segment_ids
                          'attention_mask':  batch[2],
                          'start_positions': batch[3],
                          'end_positions':   batch[4]}
            ouputs = model(**inputs)
            loss = ouputs[0]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            tr_loss += loss.item()
            optimizer.step()
            model.zero_grad()
            global_step += 1
    return global_step, tr_loss / global_step


def evaluate(args, model, tokenizer, eval_data):
    dataset, examples, features = load_and_cache_examples(args, tokenizer, eval_data, evaluate=True)
    eval_sampler = SequentialSampler(dataset)
    eval_dataloader = DataLoader(dataset, sampler=eval_sampler, batch_size=args.per_gpu_eval_batch_size)
    predictions = collections.OrderedDict()
    for batch in eval_dataloader:
        model.eval()
        batch = tuple(t.to(args.device) for t in batch)
        with torch.no_grad():
            if FIXED:
                inputs = {'input_ids':      batch[0],
                          'attention_mask': batch[1],
                          'token_type_ids': None if args.model_type == 'xlm' else batch[2]  # XLM don't use segment_ids
                          }
            else:
                inputs = {'input_ids':      batch[0],
                          'token_type_ids': None if args.model_type == 'xlm' else batch[1],  # XLM don't use segment_ids
                          'attention_mask': batch[2]}
            example_indices = batch[3]
            outputs = model(**inputs)

        for i, example_index in enumerate(example_indices):
            eval_feature = features[example_index.item()]
            start_logits = to_list(outputs[0][i])
            end_logits = to_list(outputs[1][i])
            # best span inside the paragraph (write_predictions, n-best trimmed to its first entry)
            best = None
            start_indexes = sorted(range(len(start_logits)), key=lambda x: -start_logits[x])[:args.n_best_size]
            end_indexes = sorted(range(len(end_logits)), key=lambda x: -end_logits[x])[:args.n_best_size]
            for s in start_indexes:
                for e in end_indexes:
                    if s not in eval_feature.token_to_orig_map or e not in eval_feature.token_to_orig_map:
                        continue
                    if e < s or e - s + 1 > args.max_answer_length:
                        continue
                    score = start_logits[s] + end_logits[e]
                    if best is None or score > best[0]:
                        best = (score, s, e)
            example = examples[eval_feature.example_index]
            if best is None:
                predictions[example.qas_id] = ("", None)
            else:
                _, s, e = best
                orig = example.doc_tokens[eval_feature.token_to_orig_map[s]:eval_feature.token_to_orig_map[e] + 1]
                predictions[example.qas_id] = (" ".join(orig), round(best[0], 4))
    return predictions


def make_data():
    contexts = [
        ("the red fox lives in the old forest near the river and eats small birds", [
            ("where does the fox live", "the old forest"),
            ("what does the fox eat", "small birds"),
            ("what color is the fox", "red")]),
        ("paris is the capital of france and the city has a famous tower built in iron", [
            ("what is the capital of france", "paris"),
            ("what is the tower built in", "iron")]),
        ("the young student reads a long book about the history of rome every night", [
            ("who reads the book", "the young student"),
            ("what is the book about", "the history of rome"),
            ("when does the student read", "every night")]),
    ]
    data = [{"paragraphs": []}]
    qid = 0
    for context, qas in contexts:
        para = {"context": context, "qas": []}
        for q, a in qas:
            para["qas"].append({"id": "q%d" % qid, "question": q,
                                "answers": [{"text": a, "answer_start": context.index(a)}]})
            qid += 1
        data[0]["paragraphs"].append(para)
    return data


def main():
    args = Args()
    set_seed(args)
    data = make_data()
    words = sorted({w for p in data[0]["paragraphs"] for w in
                    (p["context"] + " " + " ".join(qa["question"] for qa in p["qas"])).split()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
    tmpdir = tempfile.mkdtemp()
    vocab_file = os.path.join(tmpdir, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(vocab) + "\n")
    tokenizer = BertTokenizer.from_pretrained(tmpdir, do_lower_case=True)

    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, type_vocab_size=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForQuestionAnswering(config)
    model.to(args.device)

    train_dataset, _, _ = load_and_cache_examples(args, tokenizer, data, evaluate=False)
    global_step, tr_loss = train(args, train_dataset, model, tokenizer)
    print("global_step = %d, average loss = %.6f" % (global_step, tr_loss))

    predictions = evaluate(args, model, tokenizer, data)
    for qas_id, (text, score) in predictions.items():
        print("%s: %r (score %s)" % (qas_id, text, score))


if __name__ == "__main__":
    main()
