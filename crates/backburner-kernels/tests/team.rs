//! The spinning fork/join of `team`: every task of every region runs exactly once, on whichever thread claims it,
//! panics reach the caller, nested regions and absent members are fine.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use backburner_kernels::parallel::{for_each_chunk_mut, for_each_task};
use backburner_kernels::team::{self, Team};

/// A rayon pool of 3 threads (so the kernels split their work) and a team with `members` threads serving it.
fn with_team<R: Send>(members: usize, f: impl FnOnce() -> R + Send) -> (R, Vec<usize>) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let team = Team::new();
    let served: Vec<JoinHandle<usize>> = (0..members)
        .map(|_| {
            let t = team.clone();
            std::thread::spawn(move || {
                t.serve();
                1
            })
        })
        .collect();
    let r = pool.install(|| team::enter(&team, f));
    team.stop();
    let joined = served.into_iter().map(|h| h.join().unwrap()).collect();
    (r, joined)
}

#[test]
fn every_task_of_every_region_runs_once() {
    // Members are not threads of the rayon pool: a task they run sees no pool index, so the count of those shows
    // the regions ran on the team (rayon would run every task on a pool thread). Members may get no CPU for a
    // while when other tests run beside this one, so regions go on (up to 60 s) until members have run some.
    let on_members = AtomicUsize::new(0);
    let start = std::time::Instant::now();
    let ((), joined) = with_team(2, || {
        for region in 0.. {
            if region >= 20_000
                && (on_members.load(Ordering::Relaxed) > 0 || start.elapsed().as_secs() >= 60)
            {
                break;
            }
            let n = 1 + region % 7;
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for_each_task(n, |i| {
                hits[i].fetch_add(region + 1, Ordering::Relaxed);
                if rayon::current_thread_index().is_none() {
                    on_members.fetch_add(1, Ordering::Relaxed);
                }
            });
            for (i, h) in hits.iter().enumerate() {
                assert_eq!(
                    h.load(Ordering::Relaxed),
                    region + 1,
                    "region {region} task {i}"
                );
            }
        }
    });
    assert_eq!(joined, vec![1, 1], "both members return after stop");
    assert!(
        on_members.load(Ordering::Relaxed) > 0,
        "members ran some of the tasks"
    );
}

#[test]
fn chunks_are_disjoint_and_complete() {
    let (sums, _) = with_team(1, || {
        (0..200usize)
            .map(|r| {
                let mut data: Vec<u64> = (0..1000 + r as u64).collect();
                for_each_chunk_mut(&mut data, 37, |i, c| {
                    for (j, x) in c.iter_mut().enumerate() {
                        assert_eq!(*x, (i * 37 + j) as u64);
                        *x = *x * 2 + 1;
                    }
                });
                data.iter().sum::<u64>()
            })
            .collect::<Vec<u64>>()
    });
    for (r, s) in sums.into_iter().enumerate() {
        let n = 1000 + r as u64;
        assert_eq!(s, n * (n - 1) + n, "region {r}");
    }
}

#[test]
fn without_members_the_caller_runs_every_task() {
    let (total, joined) = with_team(0, || {
        let sum = AtomicUsize::new(0);
        for_each_task(5, |i| {
            sum.fetch_add(i + 1, Ordering::Relaxed);
        });
        sum.load(Ordering::Relaxed)
    });
    assert_eq!(total, 15);
    assert!(joined.is_empty());
}

#[test]
fn a_nested_region_runs_and_a_panic_reaches_the_caller() {
    let (outcome, _) = with_team(2, || {
        let nested = AtomicUsize::new(0);
        for_each_task(4, |_| {
            for_each_task(3, |j| {
                nested.fetch_add(j + 1, Ordering::Relaxed);
            });
        });
        assert_eq!(nested.load(Ordering::Relaxed), 4 * 6);
        let caught = catch_unwind(AssertUnwindSafe(|| {
            for_each_task(6, |i| {
                if i == 4 {
                    panic!("task 4 fails");
                }
            })
        }));
        let msg = caught
            .expect_err("the region re-raises its task's panic")
            .downcast::<&str>()
            .map(|m| *m)
            .ok();
        // the team still runs regions after the panic
        let after = AtomicUsize::new(0);
        for_each_task(6, |i| {
            after.fetch_add(i, Ordering::Relaxed);
        });
        (msg, after.load(Ordering::Relaxed))
    });
    assert_eq!(outcome, (Some("task 4 fails"), 15));
}

#[test]
fn a_region_of_another_thread_does_not_use_the_team() {
    // `enter` is per thread: a thread that did not enter runs its regions on rayon, even while a team is entered
    // elsewhere.
    let team = Team::new();
    let member = {
        let t = team.clone();
        std::thread::spawn(move || t.serve())
    };
    let seen = Arc::new(AtomicUsize::new(0));
    let s = seen.clone();
    std::thread::spawn(move || {
        for_each_task(8, |i| {
            s.fetch_add(i, Ordering::Relaxed);
        })
    })
    .join()
    .unwrap();
    team.stop();
    member.join().unwrap();
    assert_eq!(seen.load(Ordering::Relaxed), 28);
}
