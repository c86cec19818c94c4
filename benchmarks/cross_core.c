// The floor of a two-rank exchange on this machine, without Python: two threads pinned to CPUs 0 and 1.
//
//   gcc -O2 -pthread -o /tmp/cross_core benchmarks/cross_core.c && /tmp/cross_core 512 2048 8192 32768
//
// Prints the cross-core ping-pong round trip (one cache line bounced between the two cores), then for each
// message size B: ns per iteration of a symmetric exchange of B bytes each way through 4-slot rings, as the
// shared-memory all-to-all does it (copy in, release-store the counter, wait for the peer's, copy out,
// acknowledge), next to one thread's memcpy of the 2 B bytes a rank holds. Used in
// docs/results/bench_alltoall.md to separate copying and signalling from the Python around a call.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SLOTS 4
#define WARMUP 1000
static size_t B;
static long iters;
static char *ring[2];
static _Alignas(64) _Atomic long wseq[2][8], rseq[2][8], ball[8];
static double result[2];

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void pin(int cpu) { cpu_set_t s; CPU_ZERO(&s); CPU_SET(cpu, &s); pthread_setaffinity_np(pthread_self(), sizeof s, &s); }

static void *pong(void *arg) {
  (void)arg; pin(1);
  for (long i = 0; i < iters; i++) {
    while (atomic_load_explicit(&ball[0], memory_order_acquire) != 2 * i + 1) {}
    atomic_store_explicit(&ball[0], 2 * i + 2, memory_order_release);
  }
  return 0;
}

static void *exchange(void *arg) {
  long me = (long)arg, peer = 1 - me;
  pin((int)me);
  char *src = aligned_alloc(64, B), *dst = aligned_alloc(64, B);
  memset(src, (int)me + 1, B); memset(dst, 0, B);
  double t0 = 0;
  for (long i = 0; i < iters + WARMUP; i++) {
    if (i == WARMUP) t0 = now();
    while (i - atomic_load_explicit(&rseq[me][0], memory_order_acquire) >= SLOTS) {}  // a free slot in my ring
    memcpy(ring[me] + (i % SLOTS) * B, src, B);
    atomic_store_explicit(&wseq[me][0], i + 1, memory_order_release);
    while (atomic_load_explicit(&wseq[peer][0], memory_order_acquire) < i + 1) {}
    memcpy(dst, ring[peer] + (i % SLOTS) * B, B);
    atomic_store_explicit(&rseq[peer][0], i + 1, memory_order_release);
  }
  result[me] = (now() - t0) / iters;
  return 0;
}

int main(int argc, char **argv) {
  iters = 200000;
  pthread_t t[2];
  pin(0);
  pthread_create(&t[0], 0, pong, 0);
  double t0 = now();
  for (long i = 0; i < iters; i++) {
    atomic_store_explicit(&ball[0], 2 * i + 1, memory_order_release);
    while (atomic_load_explicit(&ball[0], memory_order_acquire) != 2 * i + 2) {}
  }
  printf("ping-pong round trip between CPUs 0 and 1: %.0f ns\n", (now() - t0) / iters * 1e9);
  pthread_join(t[0], 0);
  for (int a = 1; a < argc; a++) {
    B = (size_t)atol(argv[a]);
    iters = B <= 65536 ? 100000 : 5000;
    for (int r = 0; r < 2; r++) {
      ring[r] = aligned_alloc(64, SLOTS * B); memset(ring[r], 0, SLOTS * B);
      atomic_store(&wseq[r][0], 0); atomic_store(&rseq[r][0], 0);
    }
    for (long r = 0; r < 2; r++) pthread_create(&t[r], 0, exchange, (void *)r);
    for (int r = 0; r < 2; r++) pthread_join(t[r], 0);
    char *s = aligned_alloc(64, 2 * B), *d = aligned_alloc(64, 2 * B);
    memset(s, 1, 2 * B); memset(d, 0, 2 * B);
    for (int i = 0; i < WARMUP; i++) memcpy(d, s, 2 * B);
    t0 = now();
    for (long i = 0; i < iters; i++) { memcpy(d, s, 2 * B); __asm__ volatile("" ::: "memory"); }
    double local = (now() - t0) / iters;
    printf("%8zu B each way: exchange %9.0f ns per iteration (slower thread %9.0f); memcpy of %zu B alone %9.0f ns\n",
           B, result[0] * 1e9, (result[0] > result[1] ? result[0] : result[1]) * 1e9, 2 * B, local * 1e9);
    for (int r = 0; r < 2; r++) free(ring[r]);
    free(s); free(d);
  }
  return 0;
}
