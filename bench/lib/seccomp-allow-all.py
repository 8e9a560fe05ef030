"""Run a command under the smallest seccomp filter there is (one
instruction: allow every call), to measure what any filter costs."""
import ctypes
import os
import struct
import sys

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
SECCOMP_RET_ALLOW, BPF_RET_K = 0x7FFF0000, 0x06


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


libc = ctypes.CDLL(None, use_errno=True)
program = ctypes.create_string_buffer(struct.pack("HBBI", BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
fprog = SockFprog(1, ctypes.addressof(program))
if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
    sys.exit(f"prctl(PR_SET_NO_NEW_PRIVS): errno {ctypes.get_errno()}")
if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
    sys.exit(f"prctl(PR_SET_SECCOMP): errno {ctypes.get_errno()}")
os.execvp(sys.argv[1], sys.argv[1:])
