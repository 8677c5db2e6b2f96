"""benchmarks.ncu_source against a hand-written source page: opcodes without predicates or modifiers, sums by
opcode and stall reason (the "(Not Issued)" columns left out), the histogram of times run, a bad file refused."""
import pytest

from benchmarks.ncu_source import opcode, read, report

HEADER = ",".join(f'"{c}"' for c in (
    "Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
    "Instructions Executed", "stall_wait", "stall_long_sb", "stall_wait (Not Issued)"))
PAGE = '''"Kernel Name","void k(int)",
''' + HEADER + ''',
"0x10","@P1   BRA 0x40","3","1","100","2","1","9",
"0x20","      IMAD.WIDE.U32 R2, R3, R4, R5","5","5","100","1","4","9",
"0x30","      IMAD R1, R2, R3, RZ","2","0","50","2","0","9",
"0x40","      EXIT","0","0","-","0","0","9",
'''


def test_opcode_drops_predicate_and_modifiers():
    assert opcode("@!P0  BRA 0x7fe2") == "BRA"
    assert opcode("      IMAD.MOV.U32 R28, RZ, RZ, R0") == "IMAD"
    assert opcode("HMMA.16816.F32.BF16 R124, R40, R132, RZ") == "HMMA"
    assert opcode("   ") == ""


def test_source_page_sums(tmp_path):
    path = tmp_path / "sass.csv"
    path.write_text(PAGE)
    prof = read(path)
    assert prof.kernel == "void k(int)"
    assert (prof.executed, prof.samples) == (250, 10)
    assert prof.by_opcode == {"BRA": [100, 3], "IMAD": [150, 7], "EXIT": [0, 0]}
    assert dict(prof.by_stall) == {"wait": 5, "long_sb": 5}
    assert dict(prof.by_count) == {100: 2, 50: 1, 0: 1}
    text = report(prof)
    assert "| IMAD | 150 | 60.0% | 7 | 70.0% |" in text
    assert "| 100 | 2 | 200 | 80.0% |" in text
    assert "| wait | 5 | 50.0% |" in text


def test_a_file_that_is_not_a_source_page_is_refused(tmp_path):
    path = tmp_path / "raw.csv"
    path.write_text('"ID","Kernel Name"\n"0","k"\n')
    with pytest.raises(ValueError, match="not an ncu source page"):
        read(path)
    path.write_text('"Kernel Name","k",\n"Address","Source",\n')
    with pytest.raises(ValueError, match="no column Instructions Executed"):
        read(path)
