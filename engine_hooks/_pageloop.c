/* The native loop of the CPU seal: Adler-32 over many (address, length) chunks in one call,
 * so scattered small pages pay a few nanoseconds each instead of a Python call each.
 * The Adler-32 itself is zlib-ng's (its SIMD code), passed in as a function pointer by
 * engine_hooks.checksum; this file only loops. Reached through ctypes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

/* zlib-ng's zng_adler32_z */
#define PREFETCH_LINES 16

typedef uint32_t (*adler32_fn)(uint32_t adler, const uint8_t *buf, size_t len);

uint32_t kvwatch_adler32_chunks(adler32_fn adler32, uint32_t value, const uint64_t *addresses,
                                const uint64_t *lengths, size_t count) {
    for (size_t i = 0; i < count; i++) {
        if (i + 1 < count) {
            /* The next chunk is elsewhere in memory: start its first lines now, so the hardware
             * prefetcher is not cold when zlib-ng reaches it. */
            const char *next = (const char *)(uintptr_t)addresses[i + 1];
            for (size_t line = 0; line < PREFETCH_LINES && line * 64 < lengths[i + 1]; line++) {
                __builtin_prefetch(next + line * 64);
            }
        }
        value = adler32(value, (const uint8_t *)(uintptr_t)addresses[i], (size_t)lengths[i]);
    }
    return value;
}

/* The physical limit of the same access pattern: read every 8-byte word of the chunks once
 * (bench/checksum.py's baseline for a scattered page table). */
uint64_t kvwatch_read_chunks(const uint64_t *addresses, const uint64_t *lengths, size_t count) {
    uint64_t total = 0;
    for (size_t i = 0; i < count; i++) {
        const uint64_t *words = (const uint64_t *)(uintptr_t)addresses[i];
        for (size_t w = 0; w < lengths[i] / 8; w++) {
            total += words[w];
        }
    }
    return total;
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pageloop", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__pageloop(void) { return PyModule_Create(&module); }
