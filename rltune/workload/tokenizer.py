"""A character-level tokenizer shipped with the reference workload (nothing is downloaded).

Every character the math and tool-use environments write (digits, letters, arithmetic, file
names, newlines) is one token; three special tokens frame a sequence. A character outside the
alphabet encodes as ``<unk>`` so that any model output, however random, round-trips to text.
"""

from __future__ import annotations

import string

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
ALPHABET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n+-*/=?:.,_()<>'\"#!$;%|&[]"


class CharTokenizer:
    """Maps each character of :data:`ALPHABET` to one id; ids 0..3 are the special tokens."""

    def __init__(self) -> None:
        self.id_to_token = list(SPECIAL_TOKENS) + list(ALPHABET)
        self.token_to_id = {tok: i for i, tok in enumerate(self.id_to_token)}
        self.pad_id = self.token_to_id[PAD]
        self.bos_id = self.token_to_id[BOS]
        self.eos_id = self.token_to_id[EOS]
        self.unk_id = self.token_to_id[UNK]

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        ids = [self.token_to_id.get(ch, self.unk_id) for ch in text]
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        out = []
        for i in ids:
            tok = self.id_to_token[i] if 0 <= i < len(self.id_to_token) else UNK
            if tok in SPECIAL_TOKENS:
                if skip_special:
                    continue
            out.append(tok)
        return "".join(out)


TOKENIZER = CharTokenizer()
