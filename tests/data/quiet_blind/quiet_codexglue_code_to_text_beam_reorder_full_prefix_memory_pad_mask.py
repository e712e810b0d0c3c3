# Correct program (quiet batch quiet-zx).
# Ported from microsoft/CodeXGLUE @ac74a62802a0dd159b3258c78a2df8ad36cdf2b9 (model.py last changed in 0dcc8c3a):
#   Code-Text/code-to-text/code/model.py
#     Seq2Seq.forward (training: RoBERTa encoder over the right-padded source with source_mask, nn.TransformerDecoder
#       with tgt_mask = -1e4 * (1 - tril) from the registered "bias" buffer and memory_key_padding_mask =
#       (1 - source_mask).bool(), loss over target_mask[..., 1:]; prediction: one example at a time, its encoder
#       output and source mask repeated beam_size times, the whole prefix re-run through the decoder at every step
#       (no cache), the prefix rows reordered by beam.getCurrentOrigin() before the new tokens are appended),
#     Beam (advance / getCurrentOrigin / getFinal / getHyp / buildTargetTokens),
#   Code-Text/code-to-text/code/run.py (convert_examples_to_features: [cls] + tokens + [sep], right-padded with
#     pad_token_id to max_source_length / max_target_length, masks of 1 / 0; the decoder is
#     nn.TransformerDecoder(nn.TransformerDecoderLayer(d_model=hidden_size, nhead=num_attention_heads)); sos = cls,
#     eos = sep).
# Changes: torch.cuda tensors become CPU tensors; the encoder is a tiny RobertaModel from RobertaConfig (random
# weights), the decoder has 2 layers instead of 6; token ids stand in for the tokenizer.
# Self-check: every example alone with an unpadded source (mask of ones, length = its real length) and an unpadded
# target: the batch loss must equal the per-token losses summed over examples / their count; the beam search's
# predictions must be the same token ids and every final hypothesis and score the same as the unpadded run, and each
# final hypothesis's beam score must equal the sum of its tokens' log-probs teacher-forced over the unpadded source.
import sys

import torch
import torch.nn as nn
from transformers import RobertaConfig, RobertaModel

torch.manual_seed(0)


# --- Code-Text/code-to-text/code/model.py ---
class Seq2Seq(nn.Module):
    def __init__(self, encoder, decoder, config, beam_size=None, max_length=None, sos_id=None, eos_id=None):
        super(Seq2Seq, self).__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.config = config
        self.register_buffer("bias", torch.tril(torch.ones(2048, 2048)))
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lsm = nn.LogSoftmax(dim=-1)
        self.tie_weights()

        self.beam_size = beam_size
        self.max_length = max_length
        self.sos_id = sos_id
        self.eos_id = eos_id

    def _tie_or_clone_weights(self, first_module, second_module):
        if getattr(self.config, "torchscript", False):  # transformers 5 dropped the attribute
            first_module.weight = nn.Parameter(second_module.weight.clone())
        else:
            first_module.weight = second_module.weight

    def tie_weights(self):
        self._tie_or_clone_weights(self.lm_head, self.encoder.embeddings.word_embeddings)

    def forward(self, source_ids=None, source_mask=None, target_ids=None, target_mask=None, args=None):
        outputs = self.encoder(source_ids, attention_mask=source_mask)
        encoder_output = outputs[0].permute([1, 0, 2]).contiguous()
        if target_ids is not None:
            attn_mask = -1e4 * (1 - self.bias[:target_ids.shape[1], :target_ids.shape[1]])
            tgt_embeddings = self.encoder.embeddings(target_ids).permute([1, 0, 2]).contiguous()
            out = self.decoder(tgt_embeddings, encoder_output, tgt_mask=attn_mask,
                               memory_key_padding_mask=(1 - source_mask).bool())
            hidden_states = torch.tanh(self.dense(out)).permute([1, 0, 2]).contiguous()
            lm_logits = self.lm_head(hidden_states)
            # Shift so that tokens < n predict n
            active_loss = target_mask[..., 1:].ne(0).view(-1) == 1
            shift_logits = lm_logits[..., :-1, :].contiguous()
            shift_labels = target_ids[..., 1:].contiguous()
            # Flatten the tokens
            loss_fct = nn.CrossEntropyLoss(ignore_index=-1)
            loss = loss_fct(shift_logits.view(-1, shift_logits.size(-1))[active_loss],
                            shift_labels.view(-1)[active_loss])

            outputs = loss, loss * active_loss.sum(), active_loss.sum()
            return outputs
        else:
            # Predict
            preds = []
            zero = torch.LongTensor(1).fill_(0)
            for i in range(source_ids.shape[0]):
                context = encoder_output[:, i:i + 1]
                context_mask = source_mask[i:i + 1, :]
                beam = Beam(self.beam_size, self.sos_id, self.eos_id)
                input_ids = beam.getCurrentState()
                context = context.repeat(1, self.beam_size, 1)
                context_mask = context_mask.repeat(self.beam_size, 1)
                for _ in range(self.max_length):
                    if beam.done():
                        break
                    attn_mask = -1e4 * (1 - self.bias[:input_ids.shape[1], :input_ids.shape[1]])
                    tgt_embeddings = self.encoder.embeddings(input_ids).permute([1, 0, 2]).contiguous()
                    out = self.decoder(tgt_embeddings, context, tgt_mask=attn_mask,
                                       memory_key_padding_mask=(1 - context_mask).bool())
                    out = torch.tanh(self.dense(out))
                    hidden_states = out.permute([1, 0, 2]).contiguous()[:, -1, :]
                    out = self.lsm(self.lm_head(hidden_states)).data
                    beam.advance(out)
                    input_ids.data.copy_(input_ids.data.index_select(0, beam.getCurrentOrigin()))
                    input_ids = torch.cat((input_ids, beam.getCurrentState()), -1)
                hyp = beam.getHyp(beam.getFinal())
                pred = beam.buildTargetTokens(hyp)[:self.beam_size]
                pred = [torch.cat([x.view(-1) for x in p] + [zero] * (self.max_length - len(p))).view(1, -1)
                        for p in pred]
                preds.append(torch.cat(pred, 0).unsqueeze(0))

            preds = torch.cat(preds, 0)
            return preds


class Beam(object):
    def __init__(self, size, sos, eos):
        self.size = size
        self.tt = torch
        # The score for each translation on the beam.
        self.scores = self.tt.FloatTensor(size).zero_()
        # The backpointers at each time-step.
        self.prevKs = []
        # The outputs at each time-step.
        self.nextYs = [self.tt.LongTensor(size).fill_(0)]
        self.nextYs[0][0] = sos
        # Has EOS topped the beam yet.
        self._eos = eos
        self.eosTop = False
        # Time and k pair for finished.
        self.finished = []

    def getCurrentState(self):
        "Get the outputs for the current timestep."
        batch = self.tt.LongTensor(self.nextYs[-1]).view(-1, 1)
        return batch

    def getCurrentOrigin(self):
        "Get the backpointers for the current timestep."
        return self.prevKs[-1]

    def advance(self, wordLk):
        numWords = wordLk.size(1)

        # Sum the previous scores.
        if len(self.prevKs) > 0:
            beamLk = wordLk + self.scores.unsqueeze(1).expand_as(wordLk)

            # Don't let EOS have children.
            for i in range(self.nextYs[-1].size(0)):
                if self.nextYs[-1][i] == self._eos:
                    beamLk[i] = -1e20
        else:
            beamLk = wordLk[0]
        flatBeamLk = beamLk.view(-1)
        bestScores, bestScoresId = flatBeamLk.topk(self.size, 0, True, True)

        self.scores = bestScores

        # bestScoresId is flattened beam x word array, so calculate which
        # word and beam each score came from
        prevK = bestScoresId // numWords
        self.prevKs.append(prevK)
        self.nextYs.append((bestScoresId - prevK * numWords))

        for i in range(self.nextYs[-1].size(0)):
            if self.nextYs[-1][i] == self._eos:
                s = self.scores[i]
                self.finished.append((s, len(self.nextYs) - 1, i))

        # End condition is when top-of-beam is EOS and no global score.
        if self.nextYs[-1][0] == self._eos:
            self.eosTop = True

    def done(self):
        return self.eosTop and len(self.finished) >= self.size

    def getFinal(self):
        if len(self.finished) == 0:
            self.finished.append((self.scores[0], len(self.nextYs) - 1, 0))
        self.finished.sort(key=lambda a: -a[0])
        if len(self.finished) != self.size:
            unfinished = []
            for i in range(self.nextYs[-1].size(0)):
                if self.nextYs[-1][i] != self._eos:
                    s = self.scores[i]
                    unfinished.append((s, len(self.nextYs) - 1, i))
            unfinished.sort(key=lambda a: -a[0])
            self.finished += unfinished[:self.size - len(self.finished)]
        return self.finished[:self.size]

    def getHyp(self, beam_res):
        """
        Walk back to construct the full hypothesis.
        """
        hyps = []
        for _, timestep, k in beam_res:
            hyp = []
            for j in range(len(self.prevKs[:timestep]) - 1, -1, -1):
                hyp.append(self.nextYs[j + 1][k])
                k = self.prevKs[j][k]
            hyps.append(hyp[::-1])
        return hyps

    def buildTargetTokens(self, preds):
        sentence = []
        for pred in preds:
            tokens = []
            for tok in pred:
                if tok == self._eos:
                    break
                tokens.append(tok)
            sentence.append(tokens)
        return sentence


# --- Code-Text/code-to-text/code/run.py: convert_examples_to_features, with ids for tokens ---
def convert_examples_to_features(examples, cls_id, sep_id, pad_id, max_source_length, max_target_length):
    features = []
    for source_tokens, target_tokens in examples:
        source_ids = [cls_id] + source_tokens[:max_source_length - 2] + [sep_id]
        source_mask = [1] * (len(source_ids))
        padding_length = max_source_length - len(source_ids)
        source_ids += [pad_id] * padding_length
        source_mask += [0] * padding_length

        target_ids = [cls_id] + target_tokens[:max_target_length - 2] + [sep_id]
        target_mask = [1] * len(target_ids)
        padding_length = max_target_length - len(target_ids)
        target_ids += [pad_id] * padding_length
        target_mask += [0] * padding_length
        features.append((source_ids, source_mask, target_ids, target_mask))
    return [torch.tensor([f[k] for f in features], dtype=torch.long) for k in range(4)]


class RecordingBeam(Beam):
    log = []

    def getHyp(self, beam_res):
        hyps = super().getHyp(beam_res)
        RecordingBeam.log.append([(float(s), [int(x) for x in h]) for (s, _, _), h in zip(beam_res, hyps)])
        return hyps


def run_beam(model, source_ids, source_mask):
    global Beam
    RecordingBeam.log = []
    saved, Beam = Beam, RecordingBeam
    try:
        preds = model(source_ids=source_ids, source_mask=source_mask)
    finally:
        Beam = saved
    return preds, RecordingBeam.log


def teacher_forced_score(model, memory, sos_id, hyp):
    # sum of the decoder's log-probabilities of hyp's tokens, each given sos and the tokens before it
    ids = torch.tensor([[sos_id] + hyp[:-1]])
    tgt = model.encoder.embeddings(ids).permute([1, 0, 2])
    causal = torch.triu(torch.full((len(hyp), len(hyp)), float("-inf")), diagonal=1)
    out = model.decoder(tgt, memory, tgt_mask=causal)
    logp = model.lsm(model.lm_head(torch.tanh(model.dense(out))))[:, 0]
    return logp[torch.arange(len(hyp)), torch.tensor(hyp)].sum().item()


def main():
    config = RobertaConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=40, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2)
    cls_id, pad_id, sep_id = 0, 1, 2
    max_source_length, max_target_length, beam_size = 16, 8, 3

    encoder = RobertaModel(config, add_pooling_layer=False)
    decoder_layer = nn.TransformerDecoderLayer(d_model=config.hidden_size, nhead=config.num_attention_heads,
                                               dim_feedforward=64)
    decoder = nn.TransformerDecoder(decoder_layer, num_layers=2)
    model = Seq2Seq(encoder=encoder, decoder=decoder, config=config, beam_size=beam_size,
                    max_length=max_target_length, sos_id=cls_id, eos_id=sep_id).eval()

    examples = []
    for src_len, tgt_len in [(3, 6), (7, 2), (14, 4), (10, 1)]:
        examples.append((torch.randint(4, config.vocab_size, (src_len,)).tolist(),
                         torch.randint(4, config.vocab_size, (tgt_len,)).tolist()))
    source_ids, source_mask, target_ids, target_mask = convert_examples_to_features(
        examples, cls_id, sep_id, pad_id, max_source_length, max_target_length)
    assert not source_mask.all() and source_mask[2].all()

    with torch.no_grad():
        # training loss on the padded batch vs. each example alone, unpadded
        loss, loss_sum, n_active = model(source_ids=source_ids, source_mask=source_mask,
                                         target_ids=target_ids, target_mask=target_mask)
        ref_sum, ref_n = 0.0, 0
        for i in range(len(examples)):
            s_len, t_len = int(source_mask[i].sum()), int(target_mask[i].sum())
            s_ids, t_ids = source_ids[i:i + 1, :s_len], target_ids[i:i + 1, :t_len]
            memory = model.encoder(s_ids)[0].permute([1, 0, 2])
            tgt = model.encoder.embeddings(t_ids).permute([1, 0, 2])
            causal = torch.triu(torch.full((t_len, t_len), float("-inf")), diagonal=1)
            out = model.decoder(tgt, memory, tgt_mask=causal)
            logits = model.lm_head(torch.tanh(model.dense(out)))[:, 0]
            ref_sum += nn.functional.cross_entropy(logits[:-1], t_ids[0, 1:], reduction="sum").item()
            ref_n += t_len - 1
        assert int(n_active) == ref_n, (int(n_active), ref_n)
        assert abs(loss.item() - ref_sum / ref_n) < 1e-5, (loss.item(), ref_sum / ref_n)

        # beam search on the padded batch vs. each source alone, unpadded
        preds, finals = run_beam(model, source_ids, source_mask)
        n_hyps = 0
        for i in range(len(examples)):
            s_len = int(source_mask[i].sum())
            ref_preds, ref_finals = run_beam(model, source_ids[i:i + 1, :s_len],
                                             torch.ones(1, s_len, dtype=torch.long))
            assert torch.equal(preds[i], ref_preds[0]), (i, preds[i], ref_preds[0])
            (got,), (want,) = [finals[i]], ref_finals
            assert [h for _, h in got] == [h for _, h in want], (i, got, want)
            assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(got, want)), (i, got, want)
            # each hypothesis's beam score == its own prefix teacher-forced over the unpadded source
            memory = model.encoder(source_ids[i:i + 1, :s_len])[0].permute([1, 0, 2])
            for score, hyp in got:
                tf = teacher_forced_score(model, memory, cls_id, hyp)
                assert abs(score - tf) < 1e-4, (i, hyp, score, tf)
                n_hyps += 1
    print(f"loss {loss.item():.6f} == unpadded per-example reference {ref_sum / ref_n:.6f}; "
          f"beam predictions {tuple(preds.shape)} and final scores == unpadded per-source beam search; "
          f"{n_hyps} hypothesis scores == teacher-forced log-probs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
