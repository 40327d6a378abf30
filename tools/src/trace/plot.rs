//! Pictures of a replay, as SVG: above, requested, allocated and reserved
//! bytes over the trace for each replayed policy; below, each policy's
//! driver calls so far, where churn after warm-up shows as a slope. Each
//! policy keeps one colour of its own in both panels (allocated lighter,
//! reserved full).
#![forbid(unsafe_code)]

use std::path::Path;

use plotters::prelude::*;

use super::replay::{Model, ReplayReport};

const GIB: f64 = (1u64 << 30) as f64;

/// A policy's colour: the same whichever policies are drawn together.
fn colour(model: Model) -> RGBColor {
    match model {
        Model::Pytorch => RGBColor(214, 39, 40),
        Model::Tidepool => RGBColor(31, 119, 180),
        Model::WholeSegments => RGBColor(44, 160, 44),
        Model::PytorchExpandable => RGBColor(148, 103, 189),
    }
}

/// Draws the series of `reports` (one trace, any of the policies) to `path`.
pub fn write_svg(path: &Path, title: &str, reports: &[&ReplayReport]) -> Result<(), String> {
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (1100, 820)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 22))?;
        let (memory, calls) = root.split_vertically(520);
        let events = reports.iter().flat_map(|r| r.series.last()).map(|s| s.event).max().unwrap_or(1).max(1);

        let top = reports.iter().flat_map(|r| r.series.iter()).map(|s| s.reserved).max().unwrap_or(1) as f64 / GIB;
        let mut chart = ChartBuilder::on(&memory)
            .margin(16)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(0u64..events, 0f64..(top * 1.08).max(0.001))?;
        chart.configure_mesh().y_desc("memory (GiB)").draw()?;
        if let Some(first) = reports.first() {
            chart
                .draw_series(LineSeries::new(first.series.iter().map(|s| (s.event, s.requested as f64 / GIB)), &BLACK))?
                .label("requested")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
        }
        for report in reports {
            let (full, light) = (colour(report.model), colour(report.model).mix(0.45));
            let name = report.model.title();
            chart
                .draw_series(LineSeries::new(report.series.iter().map(|s| (s.event, s.allocated as f64 / GIB)), light))?
                .label(format!("allocated ({name})"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], light));
            chart
                .draw_series(LineSeries::new(report.series.iter().map(|s| (s.event, s.reserved as f64 / GIB)), full.stroke_width(2)))?
                .label(format!("reserved ({name})"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], full.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;

        let most = reports.iter().flat_map(|r| r.series.iter()).map(|s| s.driver_calls).max().unwrap_or(0).max(1);
        let mut chart = ChartBuilder::on(&calls)
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0u64..events, 0u64..most + most / 12 + 1)?;
        chart.configure_mesh().x_desc("event").y_desc("driver calls so far").draw()?;
        for report in reports {
            let full = colour(report.model);
            chart
                .draw_series(LineSeries::new(report.series.iter().map(|s| (s.event, s.driver_calls)), full.stroke_width(2)))?
                .label(report.model.title())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], full.stroke_width(2)));
        }
        // Where the steady state begins (the same event for every policy).
        if let Some(first) = reports.first() {
            let at = first.warm_up.events as u64;
            if at < events {
                chart
                    .draw_series(LineSeries::new([(at, 0), (at, most)], BLACK.mix(0.4)))?
                    .label(format!("warm-up ends ({})", first.warm_up.by.name()))
                    .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.mix(0.4)));
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| format!("cannot write {}: {e}", path.display()))
}
