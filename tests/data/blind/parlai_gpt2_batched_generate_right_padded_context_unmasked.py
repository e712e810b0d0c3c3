"""ParlAI's Hugging Face GPT-2 agent: batched generation from contexts of different lengths.

Citation: facebookresearch/ParlAI#3193 ("[gpt2] Fix GPT-2 generation when using batchsize >1",
commit 2019921ec), parlai/agents/hugging_face/gpt2.py (GPT2Decoder.forward, Gpt2Agent._pad_tensor)
with parlai/core/torch_generator_agent.py (TorchGeneratorAgent._generate) and
parlai/utils/torch.py (padded_tensor).

The bug: the agent padded each batch's contexts (text_vec) on the right with the added __null__
token. When generating, GPT2Decoder.forward fed the whole padded context as the first step's
input with ``attention_mask = None`` and no position_ids, and every later step fed only the last
token, again with no mask and the cache's arange positions. A shorter context's row therefore
attended its own trailing pad tokens, and its generated tokens sat after them (and at positions
counted from the padded width).

The fix: _pad_tensor pads on the left (``left_padded=True``); the first step is given
``attention_mask = model_input != NULL_IDX`` and ``position_ids = (mask.cumsum(-1) - 1).clamp(0)``,
and each incremental step the mask of the context plus the generated tokens and the position
``context length - 1 + number of generated tokens``.

Ported at toy sizes with random weights: transformers' GPT2Model built from GPT2Config (ParlAI
loads the pretrained "gpt2"), a stand-in dictionary with the __start__ / __end__ / __null__
tokens that --add-special-tokens adds (resize_token_embeddings as ParlAI calls it), greedy
search (beam size 1) in TorchGeneratorAgent._generate's loop. ``past=`` is spelled
``past_key_values=`` for the installed transformers, and the cache is reordered with its own
reorder_cache. The fix's re-initialisation of the added token embeddings is left out.
"""

import sys
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2Model

FIXED = "--fixed" in sys.argv


# ---- parlai/utils/torch.py -------------------------------------------------------------------
class IdentityLayer(torch.nn.Module):
    def forward(self, xs):
        return xs


def padded_tensor(
    items: List[Union[List[int], torch.LongTensor]],
    pad_idx: int = 0,
    use_cuda: bool = False,
    left_padded: bool = False,
    max_len: Optional[int] = None,
    fp16friendly: bool = False,
    device: int = -1,
) -> Tuple[torch.LongTensor, List[int]]:
    n = len(items)
    lens: List[int] = [len(item) for item in items]
    t = max(lens) if max_len is None else max_len
    t = max(t, 1)
    output = torch.LongTensor(n, t)
    output.fill_(pad_idx)
    for i, (item, length) in enumerate(zip(items, lens)):
        if length == 0:
            continue
        if not isinstance(item, torch.Tensor):
            item = torch.LongTensor(item)
        if left_padded:
            # place at end
            output[i, t - length :] = item
        else:
            # place at beginning
            output[i, :length] = item
    return output, lens


def concat_without_padding(text_idx, cand_idx, use_cuda, null_idx=0):
    """Concatenate two right padded tensors and move padding to the right."""
    assert text_idx.size(0) == cand_idx.size(0)
    segments_idx = [0, 1]
    cand_len = cand_idx.size(1)
    concat_len = text_idx.size(1) + cand_idx.size(1)
    tokens = text_idx.new_zeros(text_idx.size(0), concat_len) + null_idx
    segments = text_idx.new_zeros(text_idx.size(0), concat_len) + null_idx
    for i in range(len(tokens)):
        non_nuls = torch.sum(text_idx[i, :] != null_idx)
        tokens[i, 0:non_nuls] = text_idx[i, 0:non_nuls]
        segments[i, 0:non_nuls] = segments_idx[0]
        tokens[i, non_nuls : non_nuls + cand_len] = cand_idx[i, :]
        segments[i, non_nuls : non_nuls + cand_len] = segments_idx[1]
    return tokens, segments


# ---- a stand-in for Gpt2DictionaryAgent with --add-special-tokens true ----------------------
class _Tokenizer:
    def __init__(self, base_vocab, special):
        self.base_vocab = base_vocab
        self.special = special

    def __len__(self):
        return self.base_vocab + len(self.special)


class Gpt2DictionaryAgent:
    def __init__(self, base_vocab=48):
        self.tokenizer = _Tokenizer(base_vocab, ["__start__", "__end__", "__null__"])
        self.start_idx = base_vocab
        self.end_idx = base_vocab + 1
        self.null_idx = base_vocab + 2


# ---- parlai/agents/hugging_face/gpt2.py ------------------------------------------------------
class GPT2Decoder(torch.nn.Module):
    def __init__(self, opt, dict):
        super().__init__()
        self.transformer = self._init_from_pretrained(opt)
        # add special tokens
        if opt["add_special_tokens"]:
            self.transformer.resize_token_embeddings(len(dict.tokenizer))
        self.add_start_token = opt["add_start_token"]
        self.START_IDX = dict.start_idx
        self.NULL_IDX = dict.null_idx
        self.END_IDX = dict.end_idx
        self.use_cuda = False

    def _init_from_pretrained(self, opt):
        config = GPT2Config(
            vocab_size=opt["base_vocab"], n_positions=64, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        )
        return GPT2Model(config)

    def forward(self, input, encoder_state, incr_state=None):
        attention_mask = None
        position_ids = None
        if incr_state is None:
            # first step
            if (
                not self.add_start_token
                and input.size(1) == 1
                and int(input[0][0]) == self.START_IDX
            ):
                # generating: ignore the start token
                model_input = encoder_state
            elif FIXED:
                # forced decoding: concatenate the context
                # with the labels
                model_input = torch.cat([encoder_state, input], dim=-1)
            else:
                # forced decoding: concatenate the context
                # with the labels
                model_input, _ = concat_without_padding(
                    encoder_state, input, use_cuda=self.use_cuda, null_idx=self.NULL_IDX
                )
                attention_mask = model_input != self.NULL_IDX
            if FIXED:
                attention_mask = model_input != self.NULL_IDX
                position_ids = (
                    attention_mask.cumsum(dim=-1, dtype=torch.int64) - 1
                ).clamp_(min=0)
        else:
            if FIXED:
                if not self.add_start_token:
                    input = input[:, 1:]
                # generating with continuation
                # get the position ids
                position_ids = (encoder_state != self.NULL_IDX).sum(
                    -1, True, dtype=torch.int64
                ) - 1
                delta = ((input != self.NULL_IDX)).sum(-1, True, dtype=torch.int64)
                position_ids += delta
                attention_mask = torch.cat([encoder_state, input], dim=-1) != self.NULL_IDX
            # generation: get the last token input
            model_input = input[:, -1:]

        transformer_outputs = self.transformer(
            model_input,
            past_key_values=incr_state,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
        )
        hidden_states = transformer_outputs[0]
        new_incr_state = transformer_outputs[1]

        return hidden_states, new_incr_state


class HFGPT2Model(torch.nn.Module):
    def __init__(self, opt, dict):
        super().__init__()
        self.NULL_IDX, self.START_IDX, self.END_IDX = self._get_special_tokens(opt, dict)
        self.encoder = IdentityLayer()
        self.decoder = self._get_decoder(opt, dict)
        self.config = self.decoder.transformer.config
        self.lm_head = torch.nn.Linear(self.config.n_embd, self.config.vocab_size, bias=False)
        self._tie_weights(self.lm_head, self.decoder.transformer.wte)

    def _get_decoder(self, opt, dict):
        return GPT2Decoder(opt, dict)

    def _tie_weights(self, output_embeddings, input_embeddings):
        output_embeddings.weight = input_embeddings.weight

    def _get_special_tokens(self, opt, dict):
        return dict.null_idx, dict.start_idx, dict.end_idx

    def reorder_encoder_states(self, encoder_states, indices):
        enc = torch.index_select(encoder_states, 0, indices)
        return enc

    def output(self, tensor):
        return self.lm_head(tensor)

    def reorder_decoder_incremental_state(self, incremental_state, inds):
        incremental_state.reorder_cache(inds)
        return incremental_state


class Batch:
    def __init__(self, text_vec, text_lengths):
        self.text_vec = text_vec
        self.text_lengths = text_lengths


class Gpt2Agent:
    def __init__(self, opt):
        self.opt = opt
        self.dict = Gpt2DictionaryAgent(opt["base_vocab"])
        self.model = HFGPT2Model(opt, self.dict).eval()
        self.START_IDX = self.model.START_IDX
        self.END_IDX = self.model.END_IDX
        self.NULL_IDX = self.model.NULL_IDX
        self.use_cuda = False
        self.temperature = 1.0

    def _encoder_input(self, batch):
        return (batch.text_vec,)

    def _pad_tensor(self, items):
        return padded_tensor(
            items,
            pad_idx=self.NULL_IDX,
            use_cuda=self.use_cuda,
            left_padded=FIXED,
            fp16friendly=False,
        )

    def batchify(self, texts):
        text_vec, lens = self._pad_tensor(texts)
        return Batch(text_vec, lens)

    # ---- parlai/core/torch_generator_agent.py (greedy search, beam_size = 1) -----------------
    def _get_initial_decoder_input(self, bsz, beam_size, dev):
        return torch.LongTensor([self.START_IDX]).expand(bsz * beam_size, 1).to(dev)

    def _get_next_decoder_input(self, prev_input, selection, incr_state_inds):
        prev_input = torch.index_select(prev_input, 0, incr_state_inds)
        decoder_input = torch.cat([prev_input, selection], dim=-1)
        return decoder_input

    @torch.no_grad()
    def _generate(self, batch, beam_size, max_ts):
        model = self.model
        encoder_states = model.encoder(*self._encoder_input(batch))
        dev = batch.text_vec.device
        bsz = len(batch.text_lengths)

        decoder_input = self._get_initial_decoder_input(bsz, beam_size, dev)
        inds = torch.arange(bsz).to(dev).unsqueeze(1).repeat(1, beam_size).view(-1)
        encoder_states = model.reorder_encoder_states(encoder_states, inds)
        incr_state = None
        outputs = [[] for _ in range(bsz)]
        done = [False] * bsz

        for _ts in range(max_ts):
            if all(done):
                break
            score, incr_state = model.decoder(decoder_input, encoder_states, incr_state)
            # only need the final hidden state to make the word prediction
            score = score[:, -1:, :]
            score = model.output(score)
            score = score.view(bsz, beam_size, -1)
            score = F.log_softmax(score, dim=-1, dtype=torch.float32)
            # GreedySearch.select_paths: the best token of the single beam
            best = score[:, 0, :].argmax(dim=-1)
            for i in range(bsz):
                if not done[i]:
                    outputs[i].append(int(best[i]))
                    done[i] = int(best[i]) == self.END_IDX
            incr_state_inds = torch.arange(bsz * beam_size, device=dev)
            incr_state = model.reorder_decoder_incremental_state(incr_state, incr_state_inds)
            selection = best.unsqueeze(-1)
            decoder_input = self._get_next_decoder_input(
                decoder_input, selection, incr_state_inds
            )
        return outputs


def main():
    torch.manual_seed(0)
    opt = {
        "add_special_tokens": True,
        "add_start_token": False,
        "batchsize": 2,
        "base_vocab": 48,
    }
    agent = Gpt2Agent(opt)
    # two dialogue contexts of different lengths in one batch
    texts = [
        [5, 17, 23, 8, 41, 2, 30, 11, 19],
        [7, 33, 12, 26],
    ]
    batch = agent.batchify(texts)
    print("text_vec:", batch.text_vec.tolist())
    preds = agent._generate(batch, beam_size=1, max_ts=6)
    for i, p in enumerate(preds):
        print(f"row {i} generated:", p)


if __name__ == "__main__":
    main()
