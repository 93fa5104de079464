/* stream_st/core/_text.h: what the compiled modules that write a header's text share
 * (stream_st/core/_compact.c, stream_st/core/_small.c): a growing byte buffer, the decimal of a
 * number, and the test of a tensor name JSON writes as it is. Each module includes it once (its
 * functions are static). The GIL is held wherever they run (the buffer grows by PyMem_Realloc).
 */
#ifndef STREAM_ST_TEXT_H
#define STREAM_ST_TEXT_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    char *s;
    size_t n, cap;
} Text;

/* Room in ``t`` for ``len`` more bytes; 0 if out of memory. */
static int reserve(Text *t, size_t len) {
    if (t->n + len <= t->cap) return 1;
    size_t cap = t->cap ? t->cap : 4096;
    while (cap < t->n + len) cap *= 2;
    char *grown = PyMem_Realloc(t->s, cap);
    if (grown == NULL) return 0;
    t->s = grown;
    t->cap = cap;
    return 1;
}

/* ``len`` bytes appended to ``t``, which has room for them. */
static void put(Text *t, const char *s, size_t len) {
    memcpy(t->s + t->n, s, len);
    t->n += len;
}

#define PUT(t, lit) put((t), (lit), sizeof(lit) - 1)

/* The most bytes put_number appends. */
#define NUMBER_ROOM 20

/* ``value`` in decimal appended to ``t``, which has room for NUMBER_ROOM bytes (by hand:
   snprintf took most of a header row's time). */
static void put_number(Text *t, unsigned long long value) {
    char digits[NUMBER_ROOM];
    size_t i = sizeof digits;
    do {
        digits[--i] = (char)('0' + value % 10);
        value /= 10;
    } while (value != 0);
    put(t, digits + i, sizeof digits - i);
}

/* Whether JSON writes ``name`` as it is between quotes, and it is no header key. */
static int plain_name(const char *name, Py_ssize_t len) {
    if (len == 12 && memcmp(name, "__metadata__", 12) == 0) return 0;
    for (Py_ssize_t i = 0; i < len; i++) {
        unsigned char b = (unsigned char)name[i];
        if (b < 0x20 || b == '"' || b == '\\') return 0;
    }
    return 1;
}

#endif
