# Citation: UKPLab/EasyNMT @2fa1564bfa4e069e062920bef512f13e3cabcb61: easynmt/models/AutoModel.py
# (AutoModel.__init__ / translate_sentences: tokenizer.src_lang, tokenizer(sentences, truncation=True, padding=True),
# forced_bos_token_id = tokenizer.lang_code_to_id[target_lang], model.generate(**inputs, num_beams=beam_size)) and
# easynmt/EasyNMT.py @0ec2fd413b9c5341767d7cfbbe73ff6d9a57aae9 (EasyNMT.translate_sentences: sort by length, cut into
# batch_size mini-batches, restore the original order). The model is transformers' M2M100ForConditionalGeneration
# (tiny, built from M2M100Config, saved and reloaded with AutoModelForSeq2SeqLM.from_pretrained as EasyNMT loads it);
# M2M100Tokenizer is replaced by a small word-level stand-in with the same layout: [__src__] tokens </s>, padded on
# the right with pad_token_id 1, attention_mask 1 = real token.
#
# The tokenizer's attention_mask goes to generate(), which runs the encoder once under it, expands it num_beams
# times as the cross-attention mask over the padded memory, and decodes with a causal self-attention KV cache that
# beam search reorders every step. M2M100 counts its sinusoidal positions from the non-pad tokens, so a right-padded
# source sits at the same positions as alone. Every sentence must translate, token for token and score for score,
# exactly as it does alone with no padding and no cache.
import logging
import tempfile
from typing import List

import numpy as np
import torch
from transformers import AutoModelForSeq2SeqLM, BatchEncoding, M2M100Config, M2M100ForConditionalGeneration

logger = logging.getLogger(__name__)


class WordTokenizer:
    """Stand-in for M2M100Tokenizer (no download): one id per whitespace word, language codes as special tokens."""

    def __init__(self, words, langs, bos_token_id=0, pad_token_id=1, eos_token_id=2, unk_token_id=3):
        self.bos_token_id, self.pad_token_id = bos_token_id, pad_token_id
        self.eos_token_id, self.unk_token_id = eos_token_id, unk_token_id
        self.lang_code_to_id = {lang: 4 + i for i, lang in enumerate(langs)}
        first = 4 + len(langs)
        self.vocab = {w: first + i for i, w in enumerate(words)}
        self.id_to_word = {i: w for w, i in self.vocab.items()}
        self.special_ids = {bos_token_id, pad_token_id, eos_token_id, unk_token_id, *self.lang_code_to_id.values()}
        self.src_lang = langs[0]
        self.padding_side = "right"

    def encode(self, text):
        ids = [self.vocab.get(w, self.unk_token_id) for w in text.split()]
        return [self.lang_code_to_id[self.src_lang]] + ids + [self.eos_token_id]

    def __call__(self, sentences, truncation=True, padding=True, return_tensors="pt"):
        encoded = [self.encode(s) for s in sentences]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        return BatchEncoding({"input_ids": input_ids, "attention_mask": attention_mask})

    def decode(self, ids, skip_special_tokens=True):
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return " ".join(self.id_to_word.get(i, "<unk>") for i in ids)


class AutoModel:
    def __init__(self, model_name: str, tokenizer, easynmt_path: str = None, lang_map=None):
        if lang_map is None:
            lang_map = {}
        self.lang_map = lang_map
        if model_name == ".":
            model_name = easynmt_path
        self.model = AutoModelForSeq2SeqLM.from_pretrained(model_name)
        self.tokenizer = tokenizer

    def translate_sentences(self, sentences: List[str], source_lang: str, target_lang: str, device: str,
                            beam_size: int = 5, **kwargs):
        self.model.to(device)

        if source_lang in self.lang_map:
            source_lang = self.lang_map[source_lang]

        if target_lang in self.lang_map:
            target_lang = self.lang_map[target_lang]

        self.tokenizer.src_lang = source_lang
        inputs = self.tokenizer(sentences, truncation=True, padding=True, return_tensors="pt")

        for key in inputs:
            inputs[key] = inputs[key].to(device)

        with torch.no_grad():
            if hasattr(self.tokenizer, "lang_code_to_id"):
                kwargs["forced_bos_token_id"] = self.tokenizer.lang_code_to_id[target_lang]
            translated = self.model.generate(**inputs, num_beams=beam_size, **kwargs)
            output = [self.tokenizer.decode(t, skip_special_tokens=True) for t in translated]

        return output


class EasyNMT:
    def __init__(self, translator, device="cpu"):
        self.translator = translator
        self.device = device

    def translate_sentences(self, sentences: List[str], target_lang: str, source_lang: str,
                            beam_size: int = 5, batch_size: int = 32, **kwargs):
        if source_lang == target_lang:
            return sentences

        output = []
        # Sort by length to speed up processing
        length_sorted_idx = np.argsort([-len(sen) for sen in sentences])
        sentences_sorted = [sentences[idx] for idx in length_sorted_idx]

        for start_idx in range(0, len(sentences_sorted), batch_size):
            output.extend(self.translator.translate_sentences(sentences_sorted[start_idx:start_idx + batch_size],
                                                              source_lang=source_lang, target_lang=target_lang,
                                                              beam_size=beam_size, device=self.device, **kwargs))

        # Restore original sorting of sentences
        output = [output[idx] for idx in np.argsort(length_sorted_idx)]
        return output


def main():
    torch.manual_seed(0)
    langs = ["en", "de", "fr"]
    words = ("the a cat dog sat on mat house is big small red green runs quickly today old tree near river "
             "under bridge walks slowly").split()
    tokenizer = WordTokenizer(words, ["__%s__" % lang for lang in langs])
    vocab_size = 4 + len(langs) + len(words)

    config = M2M100Config(vocab_size=vocab_size, d_model=32, encoder_layers=2, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                          decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                          activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, init_std=0.5,
                          pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id,
                          decoder_start_token_id=tokenizer.eos_token_id)
    model = M2M100ForConditionalGeneration(config)
    with torch.no_grad():  # let </s> compete with the words so beams finish at different lengths
        model.model.shared.weight[tokenizer.eos_token_id] *= 3.0

    lang_map = {lang: "__%s__" % lang for lang in langs}
    with tempfile.TemporaryDirectory() as easynmt_path:
        model.save_pretrained(easynmt_path)
        translator = AutoModel(".", tokenizer, easynmt_path=easynmt_path, lang_map=lang_map)
    translator.model.eval()
    nmt = EasyNMT(translator, device="cpu")

    sentences = [
        "the cat sat on the mat",
        "a dog runs",
        "the old house near the river is big",
        "red tree",
        "a small green cat walks slowly under the bridge today",
        "the dog is old",
        "the river",
    ]
    gen_kwargs = dict(max_length=16)
    beam_size, batch_size = 5, 3
    translations = nmt.translate_sentences(sentences, target_lang="de", source_lang="en", beam_size=beam_size,
                                           batch_size=batch_size, **gen_kwargs)

    # Reference: every sentence alone, unpadded, decoded without a cache (full recompute each step).
    hf_model = translator.model
    forced_bos = tokenizer.lang_code_to_id["__de__"]
    length_sorted_idx = np.argsort([-len(sen) for sen in sentences])
    sorted_sentences = [sentences[i] for i in length_sorted_idx]
    padded_rows = 0
    for start in range(0, len(sorted_sentences), batch_size):
        chunk = sorted_sentences[start:start + batch_size]
        tokenizer.src_lang = "__en__"
        inputs = tokenizer(chunk)
        padded_rows += int((inputs["attention_mask"] == 0).any(1).sum())
        with torch.no_grad():
            batched = hf_model.generate(**inputs, num_beams=beam_size, forced_bos_token_id=forced_bos,
                                        return_dict_in_generate=True, output_scores=True, **gen_kwargs)
        for row, sentence in enumerate(chunk):
            alone = tokenizer([sentence])
            with torch.no_grad():
                single = hf_model.generate(input_ids=alone["input_ids"], num_beams=beam_size,
                                           forced_bos_token_id=forced_bos, use_cache=False,
                                           return_dict_in_generate=True, output_scores=True, **gen_kwargs)
            a, b = batched.sequences[row], single.sequences[0]
            a = a[a != tokenizer.pad_token_id]
            b = b[b != tokenizer.pad_token_id]
            assert torch.equal(a, b), (sentence, a.tolist(), b.tolist())
            assert torch.allclose(batched.sequences_scores[row], single.sequences_scores[0], atol=1e-4), sentence
            assert translations[sentences.index(sentence)] == tokenizer.decode(b), sentence

    assert padded_rows >= 4, padded_rows
    lengths = sorted({len(t.split()) for t in translations})
    for src, tgt in zip(sentences, translations):
        print("%-55s -> %s" % (src, tgt))
    print("ok: %d sentences in %d padded beam batches match their unpadded, uncached runs; output lengths %s"
          % (len(sentences), -(-len(sentences) // batch_size), lengths))


if __name__ == "__main__":
    main()
