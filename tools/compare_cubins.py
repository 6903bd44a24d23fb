#!/usr/bin/env python3
# Compares the SASS of kernels in two CUBINs (or kernel cache entries, *.jfk: their CUBIN is used) without
# cuobjdump/nvdisasm: per kernel, the code
# (.text.K), attributes (.nv.info.K, symbol indices zeroed), shared (.nv.shared.K) and parameter bank
# (.nv.constant0.K) sections, byte by byte. Identical sections = identical SASS (provably not slower).
#
#   compare_cubins.py A.cubin             list A's sections with a hash
#   compare_cubins.py A.cubin B.cubin [K=K2 ...]
#                                         every kernel of A against B; K=K2: A's kernel K is B's K2
#                                         (e.g. jf_x_fwd=jf_x_fwd_scalar); exit 1 on any difference
import hashlib
import struct
import sys


def cubin_of(d):
    # A cache entry (docs/cache.md, "Entry format"): magic, u32 version, then length-prefixed key, meta,
    # source and cubin.
    at = 12
    fields = []
    for _ in range(4):
        n, = struct.unpack_from('<Q', d, at)
        fields.append(d[at + 8:at + 8 + n])
        at += 8 + n
    return fields[3]


def sections(path):
    d = open(path, 'rb').read()
    if d[:8] == b'JFKENTRY':
        d = cubin_of(d)
    if d[:4] != b'\x7fELF':
        sys.exit(f'{path}: not an ELF file')
    shoff, = struct.unpack_from('<Q', d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from('<HHH', d, 0x3a)
    hdrs = [struct.unpack_from('<IIQQQQIIQQ', d, shoff + i * shentsize) for i in range(shnum)]
    stroff = hdrs[shstrndx][4]
    out = {}
    for name_off, typ, _flags, _addr, off, size, *_ in hdrs:
        name = d[stroff + name_off:d.index(b'\0', stroff + name_off)].decode()
        out[name] = d[off:off + size] if typ != 8 else b'NOBITS%d' % size  # 8: SHT_NOBITS
    return out


def info(v):
    # EIATTR records: format byte, attribute byte, then a u16 value (formats 2, 3), nothing (1) or a u16
    # size and data (4). PARAM_CBANK (0x0a) starts with a symbol index, which moves when the module has
    # more symbols: zeroed.
    out = bytearray(v)
    i = 0
    while i + 1 < len(out):
        fmt, attr = out[i], out[i + 1]
        if fmt == 4:
            size = int.from_bytes(out[i + 2:i + 4], 'little')
            if attr == 0x0a:
                out[i + 4:i + 8] = b'\0' * 4
            i += 4 + size
        elif fmt in (2, 3):
            i += 4
        else:
            i += 2
    return bytes(out)


def main():
    a = sections(sys.argv[1])
    if len(sys.argv) == 2:
        for n, v in a.items():
            print(hashlib.sha256(v).hexdigest()[:16], len(v), n)
        return 0
    b = sections(sys.argv[2])
    rename = dict(x.split('=', 1) for x in sys.argv[3:])
    bad = 0
    for n in a:
        if not n.startswith(('.text.', '.nv.info.', '.nv.shared.', '.nv.constant0.')):
            continue
        prefix, kernel = n[:n.index('.', 1) + 1], n[n.index('.', 1) + 1:]
        if n.startswith('.nv.'):
            prefix = '.'.join(n.split('.')[:3]) + '.'
            kernel = n[len(prefix):]
        m = prefix + rename.get(kernel, kernel)
        if m not in b:
            print('MISSING', m)
            bad += 1
            continue
        x, y = (info(a[n]), info(b[m])) if n.startswith('.nv.info.') else (a[n], b[m])
        same = x == y
        bad += not same
        print('same' if same else 'DIFF', n, m, len(a[n]), len(b[m]))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
