#!/bin/sh
# Recreates the demo prompt WAVs (already committed; run only to change them).
# Needs espeak-ng and sox (Debian: apt-get install espeak-ng sox). Output: mono 16-bit,
# a mix of 16 kHz and 24 kHz, trimmed of leading/trailing silence, 2-4 s each.
set -eu
cd "$(dirname "$0")/prompts"
gen() {  # name voice rate text
    espeak-ng -v "$2" -s 150 -w "/tmp/cosybatch_raw_$1.wav" "$4"
    sox "/tmp/cosybatch_raw_$1.wav" -r "$3" -c 1 -b 16 "$1.wav" norm -3 \
        silence 1 0.05 0.5% reverse silence 1 0.05 0.5% reverse
    rm -f "/tmp/cosybatch_raw_$1.wav"
}
gen p1_16k en-us 16000 "The quick brown fox jumps over the lazy dog."
gen p2_24k en-gb 24000 "She sells sea shells by the sea shore."
gen p3_16k en-us+f3 16000 "Please call Stella and ask her to bring these things."
gen p4_24k en-gb+m3 24000 "A rainbow appears when sunlight shines through rain."
