/* Preloaded into tritonserver (and so into its Python-backend stubs): fixes a lock-order deadlock in
 * the Python backend's decoupled-BLS ResponseIterator::Next() of Triton 2.51 (nvidia-pytriton 0.7.0).
 *
 * Next() waits for a response with the GIL released; when the condition variable wakes it, it holds
 * the iterator's mutex and then takes the GIL back. The stub's message thread enqueues a response while
 * holding the iterator table's mutex and then the iterator's mutex, and a Python thread starting a
 * decoupled BLS call takes the table's mutex while holding the GIL. Under concurrent streams the three
 * close a cycle (iterator mutex -> GIL -> table mutex -> iterator mutex) and the stub stops forever.
 *
 * Fix: when Next() takes the GIL back after its wait, the iterator's mutex is let go first and taken
 * again once the GIL is held (GIL before mutex, the order every other path uses). Next() re-checks its
 * queue under the mutex after waking, so this is no more than an early wakeup for it.
 *
 * Only waits that return into ResponseIterator::Next are touched: OMNI_TRITON_STUB_NEXT_RANGE gives
 * its offset and size in the stub ("<hex offset>:<hex size>", from the stub's symbol table); without
 * it, or in any other process, every call passes straight through. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int configured = -1; /* -1 unknown, 0 inactive, 1 active */
static uintptr_t next_begin, next_end;
static __thread pthread_mutex_t *relock_after_gil;

static int first_object_base(struct dl_phdr_info *info, size_t size, void *data) {
  (void)size;
  *(uintptr_t *)data = info->dlpi_addr; /* the first object listed is the executable itself */
  return 1;
}

static void configure(void) {
  const char *range = getenv("OMNI_TRITON_STUB_NEXT_RANGE");
  char exe[4096];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  int active = 0;
  if (range && len > 0) {
    exe[len] = '\0';
    char *sep;
    unsigned long offset = strtoul(range, &sep, 16), span = 0;
    if (*sep == ':') span = strtoul(sep + 1, NULL, 16);
    uintptr_t base = 0;
    if (span && strstr(exe, "triton_python_backend_stub")) {
      dl_iterate_phdr(first_object_base, &base);
      next_begin = base + offset;
      next_end = next_begin + span;
      active = 1;
    }
  }
  __atomic_store_n(&configured, active, __ATOMIC_RELEASE);
}

/* void std::condition_variable::wait(std::unique_lock<std::mutex>&) */
void _ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE(void *cv, void *lock) {
  static void (*real)(void *, void *);
  if (!real) real = (void (*)(void *, void *))dlsym(RTLD_NEXT, "_ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE");
  real(cv, lock);
  if (__atomic_load_n(&configured, __ATOMIC_ACQUIRE) < 0) configure();
  uintptr_t caller = (uintptr_t)__builtin_return_address(0);
  if (configured == 1 && caller >= next_begin && caller < next_end)
    relock_after_gil = *(pthread_mutex_t **)lock; /* unique_lock's first member: the std::mutex */
}

void PyEval_RestoreThread(void *tstate) {
  static void (*real)(void *);
  if (!real) real = (void (*)(void *))dlsym(RTLD_NEXT, "PyEval_RestoreThread");
  pthread_mutex_t *mutex = relock_after_gil;
  if (!mutex) {
    real(tstate);
    return;
  }
  relock_after_gil = NULL;
  pthread_mutex_unlock(mutex);
  real(tstate);
  pthread_mutex_lock(mutex);
}
