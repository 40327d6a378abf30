/* The check of the C tests of the C ABI: CHECK(cond, format, ...) counts a
 * pass, or prints the line and why it failed and exits 1. Define TEST_NAME
 * (the name the messages start with) before including it. */
#ifndef TIDEPOOL_TEST_CHECK_H
#define TIDEPOOL_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

static int passed;

#define CHECK(cond, ...)                                                    \
    do {                                                                    \
        if (!(cond)) {                                                      \
            fprintf(stderr, TEST_NAME ": FAILED at line %d: ", __LINE__);   \
            fprintf(stderr, __VA_ARGS__);                                   \
            fprintf(stderr, "\n");                                          \
            exit(1);                                                        \
        }                                                                   \
        passed++;                                                           \
    } while (0)

#define MIB ((size_t)1 << 20)

#endif
