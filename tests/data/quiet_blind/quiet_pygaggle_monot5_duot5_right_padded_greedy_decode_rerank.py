"""Correct program: pygaggle's monoT5 / duoT5 passage rerankers (a T5 encoder-decoder scoring
"Query: ... Document: ... Relevant:" with one decoding step and reading the logits of
"▁false" / "▁true"), run on RIGHT-padded batches of query-passage inputs through pygaggle's own
hand-written decoding loop, greedy_decode.

Project: castorini/pygaggle @08339dd31f58ef40fbaa109726402e164eeba125
  pygaggle/model/decode.py     greedy_decode (encoder run once with the padding mask; each step the
                               whole decoder prefix is re-run through prepare_inputs_for_generation
                               with encoder_outputs, past=None and the same attention_mask)
  pygaggle/model/tokenize.py   TokenizerEncodeMixin, AppendEosTokenizerMixin,
                               QueryDocumentBatchTokenizer, T5BatchTokenizer, T5DuoBatchTokenizer
                               (padding='longest', truncation, max_length=512, return_attention_mask)
  pygaggle/rerank/base.py      Query, Text, Reranker.rerank
  pygaggle/rerank/transformer.py  MonoT5.rescore (log_softmax over [false, true]),
                               DuoT5.rescore (softmax over ids 6136 / 1176, summed over permutations)

Ported to the installed transformers 5: the tokenizer is called directly (batch_encode_plus is
gone), and it is a word-level fast tokenizer built in memory with a Metaspace pre-tokenizer (so its
pieces carry "▁" as T5's sentencepiece does, "▁false" = 6136 and "▁true" = 1176 as in T5's vocab);
the model is a tiny T5ForConditionalGeneration built from T5Config (monoT5 is T5 v1.0: relu
feed-forward, tied embeddings), float64, random weights made large enough that attention matters;
torch.cuda.amp.autocast becomes torch.autocast on the model's device.  Nothing is downloaded.

Checks (each against a T5 written by hand below from the model's weights, run on each input alone,
unpadded, with no mask at all: relative buckets, RMS norm (mean square in float32, as T5 takes it),
unscaled scores, a tril in the decoder; agreement to 1e-9):
  1. greedy_decode on a padded batch (length=4): the decoded ids and the last logits of every row;
  2. MonoT5.rescore / rerank over 5 passages in batches of 2: each score and the ranking;
  3. DuoT5.rescore over the 20 ordered pairs in batches of 8: each aggregated score and the ranking.
"""
import math
import warnings
from collections import defaultdict
from copy import deepcopy
from itertools import permutations
from typing import Iterable, List, Mapping, Optional, Tuple, Union, Any
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, T5Config, T5ForConditionalGeneration
from transformers.utils import logging as hf_logging

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
torch.manual_seed(0)


# ---------------------------------------------------------------- pygaggle/rerank/base.py
class Query:
    def __init__(self, text: str, id: Optional[str] = None):
        self.text = text
        self.id = id


class Text:
    def __init__(self, text: str, metadata: Mapping[str, Any] = None, score: Optional[float] = 0,
                 title: Optional[str] = None):
        self.text = text
        if metadata is None:
            metadata = dict()
        self.metadata = metadata
        self.score = score
        self.title = title


TextType = Union[Query, Text]


class Reranker:
    def rerank(self, query: Query, texts: List[Text]) -> List[Text]:
        return sorted(self.rescore(query, texts), key=lambda x: x.score, reverse=True)

    def rescore(self, query: Query, texts: List[Text]) -> List[Text]:
        raise NotImplementedError


# ---------------------------------------------------------------- pygaggle/model/tokenize.py
TokenizerReturnType = Mapping[str, Union[torch.Tensor, List[int], List[List[int]], List[List[str]]]]


@dataclass
class QueryDocumentBatch:
    query: Query
    documents: List[Text]
    output: Optional[TokenizerReturnType] = None

    def __len__(self):
        return len(self.documents)


@dataclass
class DuoQueryDocumentBatch:
    query: Query
    doc_pairs: List[Tuple[Text, Text]]
    output: Optional[TokenizerReturnType] = None

    def __len__(self):
        return len(self.doc_pairs)


class TokenizerEncodeMixin:
    tokenizer: PreTrainedTokenizerFast = None
    tokenizer_kwargs = None

    def encode(self, strings: List[str]) -> TokenizerReturnType:
        assert self.tokenizer and self.tokenizer_kwargs is not None, 'mixin used improperly'
        ret = self.tokenizer(strings, **self.tokenizer_kwargs)
        ret['tokens'] = list(map(self.tokenizer.tokenize, strings))
        return ret


class AppendEosTokenizerMixin:
    tokenizer: PreTrainedTokenizerFast = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

    def encode(self, strings: List[str]) -> TokenizerReturnType:
        assert self.tokenizer, 'mixin used improperly'
        return super().encode([f'{x} {self.tokenizer.eos_token}' for x in strings])


class QueryDocumentBatchTokenizer(TokenizerEncodeMixin):
    def __init__(self, tokenizer, batch_size: int, pattern: str = '{query} {document}', **tokenizer_kwargs):
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.tokenizer_kwargs = tokenizer_kwargs
        self.pattern = pattern

    def traverse_query_document(self, batch_input: QueryDocumentBatch) -> Iterable[QueryDocumentBatch]:
        query = batch_input.query
        for batch_idx in range(0, len(batch_input), self.batch_size):
            docs = batch_input.documents[batch_idx:batch_idx + self.batch_size]
            outputs = self.encode([self.pattern.format(query=query.text, document=doc.text) for doc in docs])
            yield QueryDocumentBatch(query, docs, outputs)

    def traverse_duo_query_document(self, batch_input: DuoQueryDocumentBatch) -> Iterable[DuoQueryDocumentBatch]:
        query = batch_input.query
        for batch_idx in range(0, len(batch_input), self.batch_size):
            docs = batch_input.doc_pairs[batch_idx:batch_idx + self.batch_size]
            outputs = self.encode([self.pattern.format(query=query.text, document0=doc[0].text,
                                                       document1=doc[1].text) for doc in docs])
            yield DuoQueryDocumentBatch(query, docs, outputs)


class T5BatchTokenizer(AppendEosTokenizerMixin, QueryDocumentBatchTokenizer):
    def __init__(self, *args, **kwargs):
        kwargs['pattern'] = 'Query: {query} Document: {document} Relevant:'
        if 'return_attention_mask' not in kwargs:
            kwargs['return_attention_mask'] = True
        if 'padding' not in kwargs:
            kwargs['padding'] = 'longest'
        if 'truncation' not in kwargs:
            kwargs['truncation'] = True
        if 'return_tensors' not in kwargs:
            kwargs['return_tensors'] = 'pt'
        if 'max_length' not in kwargs:
            kwargs['max_length'] = 512
        super().__init__(*args, **kwargs)


class T5DuoBatchTokenizer(AppendEosTokenizerMixin, QueryDocumentBatchTokenizer):
    def __init__(self, *args, **kwargs):
        kwargs['pattern'] = 'Query: {query} Document0: {document0} Document1: {document1} Relevant:'
        if 'return_attention_mask' not in kwargs:
            kwargs['return_attention_mask'] = True
        if 'padding' not in kwargs:
            kwargs['padding'] = 'longest'
        if 'truncation' not in kwargs:
            kwargs['truncation'] = True
        if 'return_tensors' not in kwargs:
            kwargs['return_tensors'] = 'pt'
        if 'max_length' not in kwargs:
            kwargs['max_length'] = 512
        super().__init__(*args, **kwargs)


# ---------------------------------------------------------------- pygaggle/model/decode.py
DecodedOutput = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def greedy_decode(model, input_ids: torch.Tensor, length: int, attention_mask: torch.Tensor = None,
                  return_last_logits: bool = True) -> DecodedOutput:
    decode_ids = torch.full((input_ids.size(0), 1), model.config.decoder_start_token_id,
                            dtype=torch.long).to(input_ids.device)
    encoder_outputs = model.get_encoder()(input_ids, attention_mask=attention_mask)
    next_token_logits = None
    for _ in range(length):
        model_inputs = model.prepare_inputs_for_generation(
            decode_ids,
            encoder_outputs=encoder_outputs,
            past=None,
            attention_mask=attention_mask,
            use_cache=True)
        outputs = model(**model_inputs)  # (batch_size, cur_len, vocab_size)
        next_token_logits = outputs[0][:, -1, :]  # (batch_size, vocab_size)
        decode_ids = torch.cat([decode_ids, next_token_logits.max(1)[1].unsqueeze(-1)], dim=-1)
    if return_last_logits:
        return decode_ids, next_token_logits
    return decode_ids


# ---------------------------------------------------------------- pygaggle/rerank/transformer.py
prediction_tokens = {
    'castorini/monot5-base-msmarco': ['▁false', '▁true'],
    'castorini/monot5-base-msmarco-10k': ['▁false', '▁true'],
}


class MonoT5(Reranker):
    def __init__(self, pretrained_model_name_or_path: str = 'castorini/monot5-base-msmarco-10k',
                 model: T5ForConditionalGeneration = None, tokenizer: QueryDocumentBatchTokenizer = None,
                 use_amp=False, token_false=None, token_true=None):
        self.model = model
        self.tokenizer = tokenizer
        self.token_false_id, self.token_true_id = self.get_prediction_tokens(
            pretrained_model_name_or_path, self.tokenizer, token_false, token_true)
        self.pretrained_model_name_or_path = pretrained_model_name_or_path
        self.device = next(self.model.parameters(), None).device
        self.use_amp = use_amp

    @staticmethod
    def get_prediction_tokens(pretrained_model_name_or_path: str, tokenizer, token_false, token_true):
        if not (token_false and token_true):
            if pretrained_model_name_or_path in prediction_tokens:
                token_false, token_true = prediction_tokens[pretrained_model_name_or_path]
                token_false_id = tokenizer.tokenizer.get_vocab()[token_false]
                token_true_id = tokenizer.tokenizer.get_vocab()[token_true]
                return token_false_id, token_true_id
            raise Exception(f"We don't know the indexes for the non-relevant/relevant tokens for "
                            f"the checkpoint {pretrained_model_name_or_path} and you did not provide any.")
        token_false_id = tokenizer.tokenizer.get_vocab()[token_false]
        token_true_id = tokenizer.tokenizer.get_vocab()[token_true]
        return token_false_id, token_true_id

    def rescore(self, query: Query, texts: List[Text]) -> List[Text]:
        texts = deepcopy(texts)
        batch_input = QueryDocumentBatch(query=query, documents=texts)
        for batch in self.tokenizer.traverse_query_document(batch_input):
            with torch.autocast(device_type=self.device.type, enabled=self.use_amp):
                input_ids = batch.output['input_ids'].to(self.device)
                attn_mask = batch.output['attention_mask'].to(self.device)
                _, batch_scores = greedy_decode(self.model, input_ids, length=1, attention_mask=attn_mask,
                                                return_last_logits=True)

                batch_scores = batch_scores[:, [self.token_false_id, self.token_true_id]]
                batch_scores = torch.nn.functional.log_softmax(batch_scores, dim=1)
                batch_log_probs = batch_scores[:, 1].tolist()
            for doc, score in zip(batch.documents, batch_log_probs):
                doc.score = score

        return texts


class DuoT5(Reranker):
    def __init__(self, model: T5ForConditionalGeneration = None, tokenizer: QueryDocumentBatchTokenizer = None,
                 use_amp=False):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(self.model.parameters(), None).device
        self.use_amp = use_amp

    def rescore(self, query: Query, texts: List[Text]) -> List[Text]:
        texts = deepcopy(texts)
        doc_pairs = list(permutations(texts, 2))
        scores = defaultdict(float)
        batch_input = DuoQueryDocumentBatch(query=query, doc_pairs=doc_pairs)
        for batch in self.tokenizer.traverse_duo_query_document(batch_input):
            with torch.autocast(device_type=self.device.type, enabled=self.use_amp):
                input_ids = batch.output['input_ids'].to(self.device)
                attn_mask = batch.output['attention_mask'].to(self.device)
                _, batch_scores = greedy_decode(self.model, input_ids, length=1, attention_mask=attn_mask,
                                                return_last_logits=True)

                # 6136 and 1176 are the indexes of the tokens false and true in T5.
                batch_scores = batch_scores[:, [6136, 1176]]
                batch_scores = torch.nn.functional.softmax(batch_scores, dim=1)
                batch_probs = batch_scores[:, 1].tolist()
            for doc, score in zip(batch.doc_pairs, batch_probs):
                scores[doc[0].metadata['docid']] += score
                scores[doc[1].metadata['docid']] += (1 - score)

        for text in texts:
            text.score = scores[text.metadata['docid']]

        return texts


# ---------------------------------------------------------------- the tiny stand-ins (no download)
PAD, EOS, UNK = 0, 1, 2
FALSE_ID, TRUE_ID = 6136, 1176
VOCAB_SIZE = 6144

QUERY = Query("what causes ocean tides", id="q1")
PASSAGES = [
    "tides are caused by the gravitational pull of the moon and the sun on the ocean",
    "the ocean is salty",
    "spring tides happen when the sun and moon line up and neap tides when they are at right angles",
    "a tide table lists high and low water",
    "the moon",
]


def build_tokenizer():
    words = sorted({w for s in [QUERY.text] + PASSAGES for w in s.split()}
                   | {"Query:", "Document:", "Document0:", "Document1:", "Relevant:"})
    vocab = {"<pad>": PAD, "</s>": EOS, "<unk>": UNK, "▁false": FALSE_ID, "▁true": TRUE_ID}
    nxt = 3
    for w in words:
        while nxt in vocab.values():
            nxt += 1
        vocab["▁" + w] = nxt
        nxt += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # words split on whitespace, each piece marked "▁" (the space before "</s>" leaves no piece, as in T5)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    hf_tok.padding_side = "right"
    return hf_tok


def build_model():
    cfg = T5Config(vocab_size=VOCAB_SIZE, d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=2,
                   num_decoder_layers=2, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                   dropout_rate=0.0, feed_forward_proj="relu", tie_word_embeddings=True,
                   pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD)
    model = T5ForConditionalGeneration(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "relative_attention_bias" in n:
                p.normal_(0.0, 1.5)
            elif n.endswith((".q.weight", ".k.weight", ".v.weight")):
                p.normal_(0.0, 0.5)
            elif n.endswith((".o.weight", ".wi.weight", ".wo.weight")):
                p.normal_(0.0, 0.4)
            elif n == "shared.weight":
                p.normal_(0.0, 1.0)
    return model


# ---------------------------------------------------------------- the reference, written by hand
def rel_bucket(rel, bidirectional, num_buckets, max_distance):
    """rel = key position - query position, for one (q, k) pair (python ints)."""
    ret = 0
    if bidirectional:
        num_buckets //= 2
        if rel > 0:
            ret += num_buckets
        n = abs(rel)
    else:
        n = max(-rel, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return ret + min(large, num_buckets - 1)


class RefT5:
    def __init__(self, model):
        self.sd = {k: v.detach() for k, v in model.state_dict().items()}
        c = model.config
        self.H, self.dk, self.D = c.num_heads, c.d_kv, c.d_model
        self.nb, self.md, self.eps = c.relative_attention_num_buckets, c.relative_attention_max_distance, \
            c.layer_norm_epsilon
        self.L_enc, self.L_dec = c.num_layers, c.num_decoder_layers
        self.emb = self.sd["shared.weight"]

    def norm(self, x, w):
        # T5's RMS norm takes the mean square in float32 whatever the weights' dtype
        ms = (x.to(torch.float32) * x.to(torch.float32)).mean(-1, keepdim=True)
        return x * torch.rsqrt(ms + self.eps) * w

    def bias(self, table, Lq, Lk, bidirectional):
        idx = torch.tensor([[rel_bucket(j - i, bidirectional, self.nb, self.md) for j in range(Lk)]
                            for i in range(Lq)])
        return table[idx].permute(2, 0, 1)  # (H, Lq, Lk)

    def attn(self, pre, x, kv, bias, causal):
        sd = self.sd
        Lq, Lk = x.shape[0], kv.shape[0]
        out = torch.zeros(Lq, self.H * self.dk, dtype=torch.float64)
        q = x @ sd[pre + "q.weight"].T
        k = kv @ sd[pre + "k.weight"].T
        v = kv @ sd[pre + "v.weight"].T
        for h in range(self.H):
            sl = slice(h * self.dk, (h + 1) * self.dk)
            s = q[:, sl] @ k[:, sl].T + bias[h]
            if causal:
                s = s.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool).triu(1), float("-inf"))
            out[:, sl] = torch.softmax(s, -1) @ v[:, sl]
        return out @ sd[pre + "o.weight"].T

    def ff(self, pre, x):
        sd = self.sd
        return torch.relu(x @ sd[pre + "wi.weight"].T) @ sd[pre + "wo.weight"].T

    def encode(self, ids):
        sd, x = self.sd, self.emb[ids]
        b = self.bias(sd["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"],
                      len(ids), len(ids), True)
        for l in range(self.L_enc):
            p = f"encoder.block.{l}.layer."
            x = x + self.attn(p + "0.SelfAttention.", self.norm(x, sd[p + "0.layer_norm.weight"]),
                              self.norm(x, sd[p + "0.layer_norm.weight"]), b, False)
            x = x + self.ff(p + "1.DenseReluDense.", self.norm(x, sd[p + "1.layer_norm.weight"]))
        return self.norm(x, sd["encoder.final_layer_norm.weight"])

    def decode_logits(self, dec_ids, enc):
        sd, x = self.sd, self.emb[dec_ids]
        T = len(dec_ids)
        b = self.bias(sd["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"], T, T, False)
        zero = torch.zeros(self.H, T, enc.shape[0], dtype=torch.float64)
        for l in range(self.L_dec):
            p = f"decoder.block.{l}.layer."
            h = self.norm(x, sd[p + "0.layer_norm.weight"])
            x = x + self.attn(p + "0.SelfAttention.", h, h, b, True)
            x = x + self.attn(p + "1.EncDecAttention.", self.norm(x, sd[p + "1.layer_norm.weight"]), enc, zero, False)
            x = x + self.ff(p + "2.DenseReluDense.", self.norm(x, sd[p + "2.layer_norm.weight"]))
        x = self.norm(x, sd["decoder.final_layer_norm.weight"]) * self.D ** -0.5
        return x @ self.emb.T

    def greedy(self, ids, length):
        enc = self.encode(ids)
        dec = [PAD]
        logits = None
        for _ in range(length):
            logits = self.decode_logits(dec, enc)[-1]
            dec.append(int(logits.argmax()))
        return dec, logits


def ids_alone(hf_tok, text):
    return hf_tok(text + " " + hf_tok.eos_token)["input_ids"]


def main():
    hf_tok = build_tokenizer()
    model = build_model()
    ref = RefT5(model)
    ok = True

    # 1. pygaggle's decoding loop itself on one right-padded batch
    mono_tok = T5BatchTokenizer(hf_tok, batch_size=2)
    texts = [Text(p, {"docid": f"d{i}"}, 0) for i, p in enumerate(PASSAGES)]
    enc = mono_tok.encode([mono_tok.pattern.format(query=QUERY.text, document=t.text) for t in texts])
    lens = enc["attention_mask"].sum(1).tolist()
    assert len(set(lens)) == len(lens) and enc["input_ids"][enc["attention_mask"] == 0].eq(PAD).all()
    assert not enc["input_ids"].eq(UNK).any() and enc["input_ids"].eq(EOS).sum() == len(texts)
    dec_ids, last = greedy_decode(model, enc["input_ids"], length=4, attention_mask=enc["attention_mask"])
    for i, t in enumerate(texts):
        src = ids_alone(hf_tok, mono_tok.pattern.format(query=QUERY.text, document=t.text))
        assert src == enc["input_ids"][i, :lens[i]].tolist()
        r_dec, r_last = ref.greedy(src, 4)
        same = r_dec == dec_ids[i].tolist() and torch.allclose(last[i], r_last, atol=1e-9, rtol=1e-9)
        print(f"greedy_decode row {i} ({lens[i]} real of {enc['input_ids'].shape[1]}): ids {dec_ids[i].tolist()} "
              f"match alone: {same}")
        ok &= same

    # 2. monoT5
    mono = MonoT5('castorini/monot5-base-msmarco-10k', model=model, tokenizer=mono_tok)
    assert (mono.token_false_id, mono.token_true_id) == (FALSE_ID, TRUE_ID)
    ranked = mono.rerank(QUERY, texts)
    ref_scores = {}
    for t in texts:
        src = ids_alone(hf_tok, mono_tok.pattern.format(query=QUERY.text, document=t.text))
        _, lg = ref.greedy(src, 1)
        ref_scores[t.metadata["docid"]] = torch.log_softmax(lg[[FALSE_ID, TRUE_ID]], 0)[1].item()
    for t in ranked:
        good = abs(t.score - ref_scores[t.metadata["docid"]]) < 1e-9
        print(f"monoT5 {t.metadata['docid']}: {t.score:.6f} ref {ref_scores[t.metadata['docid']]:.6f} {good}")
        ok &= good
    ref_rank = sorted(ref_scores, key=ref_scores.get, reverse=True)
    ok &= [t.metadata["docid"] for t in ranked] == ref_rank
    print("monoT5 ranking:", [t.metadata["docid"] for t in ranked], "ref:", ref_rank)

    # 3. duoT5 over the ordered pairs
    duo_tok = T5DuoBatchTokenizer(hf_tok, batch_size=8)
    duo = DuoT5(model=model, tokenizer=duo_tok)
    ranked = duo.rerank(QUERY, texts)
    ref_duo = defaultdict(float)
    for a, b in permutations(texts, 2):
        src = ids_alone(hf_tok, duo_tok.pattern.format(query=QUERY.text, document0=a.text, document1=b.text))
        _, lg = ref.greedy(src, 1)
        p = torch.softmax(lg[[FALSE_ID, TRUE_ID]], 0)[1].item()
        ref_duo[a.metadata["docid"]] += p
        ref_duo[b.metadata["docid"]] += 1 - p
    for t in ranked:
        good = abs(t.score - ref_duo[t.metadata["docid"]]) < 1e-9
        print(f"duoT5 {t.metadata['docid']}: {t.score:.6f} ref {ref_duo[t.metadata['docid']]:.6f} {good}")
        ok &= good
    ref_rank = sorted(ref_duo, key=ref_duo.get, reverse=True)
    ok &= [t.metadata["docid"] for t in ranked] == ref_rank
    print("duoT5 ranking:", [t.metadata["docid"] for t in ranked], "ref:", ref_rank)

    print("ALL OK" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
