"""onnxruntime-genai: a prompt's EOS token was taken for padding when pad_token_id == eos_token_id.

Citation: microsoft/onnxruntime-genai#1694 (fixes #1682), commit 9b80483
"fix pad vs. eos token misidentification" (src/models/position_inputs.cpp,
``DefaultPositionInputs::CreateAndInitializePositionIDs`` / ``CreateAndInitializeAttentionMask``).

The bug: on the first ``Update`` (the prompt) the position inputs are built from the token ids:
every token equal to ``model.pad_token_id`` gets attention_mask 0 and position id 0, and the
other tokens get the running count of non-pad tokens. Phi-2's genai_config sets pad_token_id ==
eos_token_id == 50256, so an ``<|endoftext|>`` inside a batch-of-one prompt
("This is a test.<|endoftext|>", the PR's test) is masked out of the prefill and its key is
rotated at position 0; decoding steps then rebuild an all-ones mask and positions from
``total_length``, so the cached EOS key comes back at the wrong position.

The fix: batch size 1 has no padding, so the mask is all ones and positions are 0..n-1; for
larger batches only the trailing run of pad tokens (scanning each row backwards) is padding.

Kept from onnxruntime-genai: DefaultPositionInputs (Update, CreateAndInitialize*, the CPU
device interface's UpdatePositionIds / UpdateAttentionMask), the Generator's AppendTokenSequences
/ GenerateNextToken / IsDone flow with greedy search and max_length, config.model.pad_token_id.
The ONNX decoder is stood in for by a tiny random transformers PhiForCausalLM fed the same
input_ids / attention_mask / position_ids / past key values.
"""

import sys

import torch
from transformers import DynamicCache, PhiConfig, PhiForCausalLM

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- genai_config.json (trimmed)


class Config:
    class model:
        pad_token_id = 50256
        eos_token_id = 50256
        bos_token_id = 50256

    class search:
        max_length = 24
        num_beams = 1
        do_sample = False


# ---------------------------------------------------------------- src/cpu/interface.cpp (trimmed)


class CpuInterface:
    @staticmethod
    def UpdatePositionIds(position_ids, batch_beam_size, total_length, new_kv_length):
        if batch_beam_size == 1:
            # For batch size == 1 we calculate position ids with total length and new kv length
            for i in range(new_kv_length):
                position_ids[0, i] = i + total_length - new_kv_length
        else:
            # For batch size > 1 we increment position ids by 1
            for i in range(batch_beam_size):
                position_ids[i, 0] += 1
        return position_ids

    @staticmethod
    def UpdateAttentionMask(mask_data, batch_beam_size, total_length):
        next_mask_data = torch.zeros((batch_beam_size, total_length), dtype=mask_data.dtype)
        if batch_beam_size == 1:
            # For batch size == 1 we assume no padding.
            next_mask_data[:] = 1
        else:
            for i in range(batch_beam_size):
                next_mask_data[i, : total_length - 1] = mask_data[i, : total_length - 1]
                next_mask_data[i, total_length - 1] = 1
        return next_mask_data


# ---------------------------------------------------------------- src/models/position_inputs.cpp


class DefaultPositionInputs:
    def __init__(self, config, batch_size):
        self.config_ = config
        self.position_ids_shape_ = [batch_size, 0]
        self.attention_mask_shape_ = [batch_size, 0]
        self.position_ids_ = None
        self.position_ids_next_ = None
        self.attention_mask_ = None
        self.is_first_update_ = True

    def Update(self, next_tokens, total_length, new_length):
        if self.is_first_update_:
            self.position_ids_shape_[1] = new_length
            self.CreateAndInitializePositionIDs(next_tokens, self.position_ids_shape_)
        else:
            self.UpdatePositionIDs(total_length, new_length)
        if self.is_first_update_:
            self.attention_mask_shape_[1] = new_length
            self.CreateAndInitializeAttentionMask(next_tokens, self.attention_mask_shape_)
        else:
            self.UpdateAttentionMask(total_length, new_length)
        self.is_first_update_ = False

    def CreateAndInitializePositionIDs(self, next_tokens, shape):
        pad = self.config_.model.pad_token_id
        position_data = torch.zeros(shape, dtype=torch.long)
        position_data_next = torch.zeros((shape[0], 1), dtype=torch.long)
        word_id = next_tokens.view(shape[0], shape[1])
        if not FIXED:
            # Set position id to be 0 for pad tokens, and accumulated sum of mask for other tokens
            for i in range(shape[0]):
                abs_position = 0
                for j in range(shape[1]):
                    if word_id[i, j] == pad:
                        position_data[i, j] = 0
                    else:
                        position_data[i, j] = abs_position
                        abs_position += 1
                position_data_next[i, 0] = abs_position - 1
        elif shape[0] == 1:
            # If batch_size is 1 we have no padding, so we do simple ascending
            for i in range(shape[1]):
                position_data[0, i] = i
            position_data_next[0, 0] = shape[1] - 1
        else:
            # Otherwise we iterate backwards as to not misinterpret any right pad tokens
            for i in range(shape[0] - 1, -1, -1):
                abs_position = shape[1] - 1
                found_first_non_pad = False
                for j in range(shape[1] - 1, -1, -1):
                    if found_first_non_pad:
                        position_data[i, j] = abs_position
                    elif word_id[i, j] != pad:
                        found_first_non_pad = True
                        position_data[i, j] = abs_position
                        position_data_next[i, 0] = abs_position
                    else:
                        position_data[i, j] = 0
                    abs_position -= 1
        nb = self.config_.search.num_beams
        self.position_ids_ = position_data.repeat_interleave(nb, dim=0)
        self.position_ids_next_ = position_data_next.repeat_interleave(nb, dim=0)
        self.position_ids_shape_[0] *= nb

    def CreateAndInitializeAttentionMask(self, next_tokens, shape):
        pad = self.config_.model.pad_token_id
        mask_data = torch.zeros(shape, dtype=torch.long)
        word_id = next_tokens.view(shape[0], shape[1])
        if not FIXED:
            # Set attention mask to be 0 for pad tokens, and 1 for all other tokens.
            for i in range(shape[0]):
                for j in range(shape[1]):
                    mask_data[i, j] = 0 if word_id[i, j] == pad else 1
        elif shape[0] == 1:
            # If batch size is 1, we have no padding, so we simply set all tokens to 1
            mask_data[:] = 1
        else:
            for i in range(shape[0] - 1, -1, -1):
                found_first_non_pad = False
                for j in range(shape[1] - 1, -1, -1):
                    if found_first_non_pad:
                        mask_data[i, j] = 1
                    elif word_id[i, j] != pad:
                        found_first_non_pad = True
                        mask_data[i, j] = 1
                    else:
                        mask_data[i, j] = 0
        nb = self.config_.search.num_beams
        self.attention_mask_ = mask_data.repeat_interleave(nb, dim=0)
        self.attention_mask_shape_[0] *= nb

    def UpdatePositionIDs(self, total_length, new_kv_length):
        if self.position_ids_shape_[1] != new_kv_length:
            self.position_ids_shape_[1] = new_kv_length
            if self.position_ids_next_ is not None and self.position_ids_shape_[0] > 1 and new_kv_length == 1:
                self.position_ids_ = self.position_ids_next_
                self.position_ids_next_ = None
            else:
                self.position_ids_ = torch.zeros(self.position_ids_shape_, dtype=torch.long)
        self.position_ids_ = CpuInterface.UpdatePositionIds(
            self.position_ids_, self.position_ids_shape_[0], total_length, new_kv_length
        )

    def UpdateAttentionMask(self, total_length, new_kv_length):
        self.attention_mask_shape_[1] = total_length
        self.attention_mask_ = CpuInterface.UpdateAttentionMask(
            self.attention_mask_, self.attention_mask_shape_[0], total_length
        )


# ---------------------------------------------------------------- the decoder (ONNX stand-in)


class DecoderState:
    def __init__(self, config, model, batch_size):
        self.model_ = model
        self.position_inputs_ = DefaultPositionInputs(config, batch_size)
        self.kv_cache_ = DynamicCache()
        self.logits_ = None

    @torch.no_grad()
    def Run(self, next_tokens, total_length, new_length):
        self.position_inputs_.Update(next_tokens, total_length, new_length)
        out = self.model_(
            input_ids=next_tokens.view(-1, new_length),
            attention_mask=self.position_inputs_.attention_mask_,
            position_ids=self.position_inputs_.position_ids_,
            past_key_values=self.kv_cache_,
            use_cache=True,
        )
        self.kv_cache_ = out.past_key_values
        self.logits_ = out.logits[:, -1, :]
        return self.logits_


# ---------------------------------------------------------------- src/generators.cpp (greedy only)


class Generator:
    def __init__(self, config, model, batch_size=1):
        self.config_ = config
        self.state_ = DecoderState(config, model, batch_size)
        self.sequences_ = torch.zeros((batch_size, 0), dtype=torch.long)
        self.done_ = False
        self.computed_logits_ = False

    def AppendTokenSequences(self, sequences):
        new_length = sequences.shape[1]
        self.sequences_ = torch.cat([self.sequences_, sequences], dim=1)
        self.state_.Run(sequences.reshape(-1), self.sequences_.shape[1], new_length)
        self.computed_logits_ = True

    def GenerateNextToken(self):
        if not self.computed_logits_:
            next_tokens = self.sequences_[:, -1]
            self.state_.Run(next_tokens, self.sequences_.shape[1], 1)
        self.computed_logits_ = False
        next_token = self.state_.logits_.argmax(dim=-1)  # GreedySearch SelectTop
        self.sequences_ = torch.cat([self.sequences_, next_token[:, None]], dim=1)
        if (next_token == self.config_.model.eos_token_id).all():
            self.done_ = True
        if self.sequences_.shape[1] >= self.config_.search.max_length:
            self.done_ = True

    def IsDone(self):
        return self.done_

    def GetSequence(self, index):
        return self.sequences_[index]


def main():
    torch.manual_seed(0)
    cfg = PhiConfig(
        vocab_size=51200,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
        pad_token_id=50256,
        bos_token_id=50256,
        eos_token_id=50256,
        initializer_range=0.2,
    )
    model = PhiForCausalLM(cfg).eval()

    # tokenizer.Encode("This is a test.<|endoftext|>") with phi-2's tokenizer
    input_sequence = torch.tensor([[1212, 318, 257, 1332, 13, 50256]])

    generator = Generator(Config, model, batch_size=1)
    generator.AppendTokenSequences(input_sequence)
    prompt_mask = generator.state_.position_inputs_.attention_mask_.clone()
    prompt_positions = generator.state_.position_inputs_.position_ids_.clone()
    first_logits = generator.state_.logits_.clone()
    while not generator.IsDone():
        generator.GenerateNextToken()

    print("prompt attention_mask:", prompt_mask[0].tolist(), "position_ids:", prompt_positions[0].tolist())
    print("output ids:", generator.GetSequence(0).tolist())
    print("first-step logits[:4]:", [round(v, 5) for v in first_logits[0, :4].tolist()])


if __name__ == "__main__":
    main()
