"""CodeT5 (salesforce/CodeT5) on right-padded sources: the defect/clone model's <eos> vector and
beam-search generation.

Port of salesforce/CodeT5 @71ccd1277350a88866cb108b0c19c7d826007527
  CodeT5/models.py  DefectModel.get_t5_vec / forward
      attention_mask = source_ids.ne(pad); encoder(input_ids, attention_mask, labels=source_ids,
      decoder_attention_mask=attention_mask, output_hidden_states=True); the last decoder hidden
      state at the (single) <eos> position is the sequence vector.
  CodeT5/_utils.py  convert_examples_to_features: tokenizer.encode(..., padding='max_length')
      -> [<s>=1, ..., </s>=2, <pad>=0, ...]
  CodeT5/run_gen.py eval_bleu_epoch: source_mask = source_ids.ne(pad);
      model.generate(source_ids, attention_mask=source_mask, use_cache=True, num_beams=..,
                     early_stopping=task == 'summarize', max_length=max_target_length)
The T5 is transformers' T5ForConditionalGeneration built from a tiny T5Config (CodeT5 ids:
pad 0 = decoder_start, bos 1, eos 2). No downloads.
"""
import torch
import torch.nn as nn
from transformers import T5Config, T5ForConditionalGeneration

torch.manual_seed(0)
PAD, BOS, EOS = 0, 1, 2

config = T5Config(
    vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
    relative_attention_num_buckets=8, relative_attention_max_distance=20, dropout_rate=0.0,
    pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, decoder_start_token_id=PAD,
    feed_forward_proj="relu", tie_word_embeddings=True,
)
t5 = T5ForConditionalGeneration(config).eval()


class DefectModel(nn.Module):
    def __init__(self, encoder, config, pad_token_id):
        super().__init__()
        self.encoder = encoder
        self.config = config
        self.pad_token_id = pad_token_id
        self.classifier = nn.Linear(config.hidden_size, 2)

    def get_t5_vec(self, source_ids):
        attention_mask = source_ids.ne(self.pad_token_id)
        outputs = self.encoder(input_ids=source_ids, attention_mask=attention_mask,
                               labels=source_ids, decoder_attention_mask=attention_mask,
                               output_hidden_states=True)
        hidden_states = outputs["decoder_hidden_states"][-1]
        eos_mask = source_ids.eq(self.config.eos_token_id)
        if len(torch.unique(eos_mask.sum(1))) > 1:
            raise ValueError("All examples must have the same number of <eos> tokens.")
        vec = hidden_states[eos_mask, :].view(hidden_states.size(0), -1,
                                              hidden_states.size(-1))[:, -1, :]
        return vec

    def forward(self, source_ids=None, labels=None, block_size=None):
        source_ids = source_ids.view(-1, block_size)
        vec = self.get_t5_vec(source_ids)
        logits = self.classifier(vec)
        prob = nn.functional.softmax(logits, dim=-1)
        if labels is not None:
            loss = nn.CrossEntropyLoss()(logits, labels)
            return loss, prob
        return prob


def encode(body, max_length):
    """tokenizer.encode(source, max_length=..., padding='max_length', truncation=True)."""
    ids = [BOS] + body[: max_length - 2] + [EOS]
    ids = ids + [PAD] * (max_length - len(ids))
    assert ids.count(EOS) == 1
    return ids


g = torch.Generator().manual_seed(1)
bodies = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (9, 4, 13, 6)]
MAX_SRC = 16
source_ids = torch.tensor([encode(b, MAX_SRC) for b in bodies])
labels = torch.tensor([0, 1, 1, 0])
model = DefectModel(t5, config, PAD).eval()

ok = True
with torch.no_grad():
    # --- defect / clone vector ---
    loss, prob = model(source_ids, labels, block_size=MAX_SRC)
    vec = model.get_t5_vec(source_ids)
    logits_alone = []
    for b, body in enumerate(bodies):
        alone = torch.tensor([encode(body, len(body) + 2)])       # no padding at all
        assert PAD not in alone[0].tolist()
        v1 = model.get_t5_vec(alone)
        ok &= torch.allclose(v1[0], vec[b], atol=1e-5)
        logits_alone.append(model.classifier(v1)[0])
    loss1 = nn.CrossEntropyLoss()(torch.stack(logits_alone), labels)
    ok &= torch.allclose(loss, loss1, atol=1e-5)
    print("eos vectors and defect loss match each source alone:", ok)

    # independent reference for the <eos> vector: run the decoder position by position
    # (prefix only: decoder_start + source[:i]) with no decoder mask at all, unpadded
    for b, body in enumerate(bodies):
        src = torch.tensor([encode(body, len(body) + 2)])
        i = src[0].tolist().index(EOS)
        dec_in = torch.cat([torch.tensor([[PAD]]), src[:, :i]], 1)            # shift_right, cut at eos
        out = t5(input_ids=src, decoder_input_ids=dec_in, output_hidden_states=True)
        ok &= torch.allclose(out.decoder_hidden_states[-1][0, -1], vec[b], atol=1e-5)
    print("eos vectors match prefix-only decoder runs:", ok)

    # --- run_gen.py beam search over the padded batch ---
    source_mask = source_ids.ne(PAD)
    preds = t5.generate(source_ids, attention_mask=source_mask, use_cache=True, num_beams=3,
                        early_stopping=True, max_length=8, do_sample=False,
                        return_dict_in_generate=True, output_scores=True)
    for b, body in enumerate(bodies):
        alone = torch.tensor([encode(body, len(body) + 2)])
        p1 = t5.generate(alone, attention_mask=alone.ne(PAD), use_cache=True, num_beams=3,
                         early_stopping=True, max_length=8, do_sample=False,
                         return_dict_in_generate=True, output_scores=True)
        a = preds.sequences[b].tolist()
        s = p1.sequences[0].tolist()
        strip = lambda x: x[:1] + [t for t in x[1:] if t != PAD] if EOS in x else x
        same = strip(a) == strip(s)
        ok &= same
        ok &= torch.allclose(preds.sequences_scores[b], p1.sequences_scores[0], atol=1e-4)

    # greedy cached decode of the padded batch vs a no-cache loop per source alone
    greedy = t5.generate(source_ids, attention_mask=source_mask, use_cache=True, num_beams=1,
                         max_length=8, do_sample=False)
    for b, body in enumerate(bodies):
        src = torch.tensor([encode(body, len(body) + 2)])
        dec = torch.tensor([[PAD]])
        for _ in range(7):
            nxt = t5(input_ids=src, decoder_input_ids=dec, use_cache=False).logits[0, -1].argmax()
            dec = torch.cat([dec, nxt.view(1, 1)], 1)
            if nxt.item() == EOS:
                break
        got = greedy[b, : dec.size(1)]
        ok &= torch.equal(got, dec[0])
    print("beam search and greedy generation match each source alone:", ok)

print("MATCH" if ok else "MISMATCH")
assert ok
